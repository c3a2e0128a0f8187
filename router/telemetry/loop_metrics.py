"""Metric families for the request path: plain numbers updated on the event loop's thread,
read by the registry at scrape time.

prometheus_client's Counter.inc is four Python calls and a lock, Histogram.observe a scan of
its buckets with a locked add each: ~5k and ~10k instructions, ~15 updates a request. The
families below keep plain numbers, updated from the event loop's thread only (where the
request path runs), and the registry reads them at scrape time, as ``Metric`` families with
the very samples prometheus_client's own classes would give (tests/test_metrics.py compares
the two pages). ``Metrics`` (router/telemetry/metrics.py) declares them.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString


class _CounterSeries:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        return [("_total", {}, self.value), ("_created", {}, self.created)]


class _GaugeSeries:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        return [("", {}, self.value)]


class _HistogramSeries:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds  # ascending, +Inf last
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount == amount:  # a NaN falls in no bucket
            self.counts[bisect_left(self.bounds, amount)] += 1

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        out: list[tuple[str, dict[str, str], float]] = []
        acc = 0.0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            acc += n
            out.append(("_bucket", {"le": floatToGoString(bound)}, acc))
        out.append(("_count", {}, acc))
        if self.bounds[0] >= 0:  # prometheus_client leaves out a sum that may go down
            out.append(("_sum", {}, self.sum))
        out.append(("_created", {}, self.created))
        return out


S = TypeVar("S", _CounterSeries, _GaugeSeries, _HistogramSeries)


class LoopFamily(Generic[S]):
    """A metric family and its labelled series, exposed by the registry it is registered in."""

    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        # An unlabelled family is its one series, exposed from the start (as stock).
        self._only: S | None = None if self.labelnames else self._series.setdefault((), self._new())
        if registry is not None:
            registry.register(self)

    def _new(self) -> S:
        raise NotImplementedError

    def labels(self, *values: object) -> S:
        """The series of these label values (made on first use), as ``Counter.labels``."""
        if not self.labelnames:
            raise ValueError(f"No label names were set when constructing {self.name}")
        if len(values) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = self._new()
        return found

    def _one(self) -> S:
        if self._only is None:
            raise ValueError(f"{self.name} has labels: use labels() first")
        return self._only

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, series in self._series.items():
            labels = dict(zip(self.labelnames, values, strict=True))
            for suffix, extra, value in series.samples():
                metric.add_sample(self.name + suffix, {**labels, **extra}, value)
        return [metric]


class LoopCounter(LoopFamily[_CounterSeries]):
    """``prometheus_client.Counter``'s exposition, for counters the event loop updates."""

    kind = "counter"

    def _new(self) -> _CounterSeries:
        return _CounterSeries()

    def inc(self, amount: float = 1) -> None:
        self._one().inc(amount)


class LoopGauge(LoopFamily[_GaugeSeries]):
    """``prometheus_client.Gauge``'s exposition (set, inc, dec), for the event loop's gauges."""

    kind = "gauge"

    def _new(self) -> _GaugeSeries:
        return _GaugeSeries()

    def set(self, value: float) -> None:
        self._one().set(value)


class LoopHistogram(LoopFamily[_HistogramSeries]):
    """``prometheus_client.Histogram``'s exposition, for histograms the event loop updates."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        buckets: Sequence[float] = (),
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(bounds) < 1:
            raise ValueError("Buckets not in sorted order")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> _HistogramSeries:
        return _HistogramSeries(self.bounds)

    def observe(self, amount: float) -> None:
        self._one().observe(amount)
