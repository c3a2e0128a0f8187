"""The request path's metric families (router/telemetry/metrics.py ``LoopCounter``, ``LoopGauge``,
``LoopHistogram``: plain numbers read at scrape time) expose exactly what prometheus_client's
own Counter, Gauge and Histogram expose for the same updates: the gateway's ``/metrics`` page
is compared byte for byte with one built from the stock classes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, Histogram

import router.telemetry.metrics
from router.telemetry.metrics import LoopCounter, LoopGauge, LoopHistogram, Metrics

# Values on, between, below and above the bucket bounds; a negative error; infinities.
OBSERVED = [0.0, 0.0001, 0.00025, 0.0003, 0.001, 1.0, 1.5, 100.0, -1.0, math.inf, 5e-05]
ERRORS = [-5000, -4096, -17, -1, 0, 0.5, 16, 4096, 4097, -math.inf, math.inf]


def _stock(monkeypatch: pytest.MonkeyPatch) -> Metrics:
    """Metrics built from prometheus_client's own classes."""
    with monkeypatch.context() as m:
        m.setattr(router.telemetry.metrics, "LoopCounter", Counter)
        m.setattr(router.telemetry.metrics, "LoopGauge", Gauge)
        m.setattr(router.telemetry.metrics, "LoopHistogram", Histogram)
        return Metrics()


def _drive(metrics: Metrics, labelled: bool) -> None:
    """The same updates, through ``child`` (the hot path's way) or ``labels``."""

    def series(metric: Any, *values: str) -> Any:
        return metrics.child(metric, *values) if labelled else metric.labels(*values)

    for i, replica in enumerate(["http://b:1", "http://a:2", 'x"y\\z\n']):
        series(metrics.requests, replica, "ring_spill", "ok").inc()
        series(metrics.requests, replica, "ring_spill", "http_500").inc(2)
        series(metrics.upstream_ttft, replica).observe(OBSERVED[i])
        series(metrics.inflight, replica).inc()
        series(metrics.inflight, replica).dec(0.5)
        series(metrics.retries, replica, "connect")
    for tenant in ["default", "t2"]:
        series(metrics.prompt_tokens, tenant).inc(6093)
        series(metrics.predicted_cached_tokens, tenant).inc(0)
        series(metrics.reported_cached_tokens, tenant).inc(12.5)
        series(metrics.tenant_requests, tenant).inc()
    series(metrics.model_requests, "m", "tokens").inc()
    series(metrics.model_predicted_cached_tokens, "m").inc(3040)
    series(metrics.model_reported_cached_tokens, "m").inc(3024)
    series(metrics.model_drift, "m").set(0.25)
    series(metrics.model_drifting, "m").set(True)
    series(metrics.decisions, "ring_spill", "prefix").inc()
    series(metrics.prefix_holders, "ring_spill").observe(3)
    series(metrics.spills, "ring_spill", "queue_cap").inc()
    series(metrics.spill_evictions, "ring_spill").inc(190)
    series(metrics.lazy_tail, "head").inc()
    for v in OBSERVED:
        metrics.tokenize_latency.observe(v)
        metrics.decision_latency.observe(v / 3)
    for v in ERRORS:
        metrics.prediction_error.observe(v)


@pytest.mark.parametrize("labelled", [True, False])
def test_the_page_is_the_stock_classes_page(
    monkeypatch: pytest.MonkeyPatch, labelled: bool
) -> None:
    ours, stock = Metrics(), _stock(monkeypatch)
    assert type(ours.requests) is LoopCounter and type(stock.requests) is Counter
    assert ours.exposition() == stock.exposition()  # before any update
    _drive(ours, labelled)
    _drive(stock, labelled)
    page = ours.exposition()
    assert page == stock.exposition()
    assert (
        b'prefix_router_requests_total{outcome="ok",policy="ring_spill",replica="http://b:1"} 1.0'
        in page
    )
    # The registry's own readers see the same samples (created timestamps aside).
    for name, labels in [
        ("prefix_router_prompt_tokens_total", {"tenant": "t2"}),
        ("prefix_router_tokenize_seconds_count", {}),
        ("prefix_router_prediction_error_tokens_bucket", {"le": "-16.0"}),
        ("prefix_router_upstream_ttft_seconds_sum", {"replica": "http://a:2"}),
        ("prefix_router_inflight_requests", {"replica": "http://a:2"}),
    ]:
        got = ours.registry.get_sample_value(name, labels)
        assert got is not None and got == stock.registry.get_sample_value(name, labels)


def test_nan_and_the_stock_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, stock = Metrics(), _stock(monkeypatch)
    for m in (ours, stock):
        m.tokenize_latency.observe(math.nan)  # in the sum, in no bucket
        with pytest.raises(ValueError):
            m.requests.labels("r", "p", "ok").inc(-1)
        with pytest.raises(ValueError):
            m.requests.labels("r", "p")  # a label short
    assert ours.exposition() == stock.exposition()
    with pytest.raises(ValueError):
        LoopCounter("c", "doc", ["a"]).inc()  # a labelled family has no series of its own
    assert LoopGauge("g", "doc").collect()[0].samples[0].value == 0.0
    assert LoopHistogram("h", "doc", buckets=(1, 2)).bounds == [1.0, 2.0, math.inf]
