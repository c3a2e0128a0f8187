"""Requests placed on each replica lately: the history the share bound reads."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence


class RecentCounts:
    """Requests routed to each replica, exponentially decayed (half-life ``half_life_s``)."""

    def __init__(
        self, half_life_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._values: dict[str, tuple[float, float]] = {}  # url -> (count, at)

    def _now(self, url: str, now: float) -> float:
        value, at = self._values.get(url, (0.0, now))
        return value * math.exp(-self.rate * (now - at))

    def add(self, url: str) -> None:
        now = self.clock()
        self._values[url] = (self._now(url, now) + 1.0, now)

    def counts(self, urls: Sequence[str]) -> dict[str, float]:
        now = self.clock()
        return {u: self._now(u, now) for u in urls}


class PrefixRates:
    """Requests per prefix key (block 0's ring key), exponentially decayed, and their total:
    a prefix's share of recent traffic. Keys whose count has decayed below ``FORGET`` are
    dropped every ``SWEEP`` additions, so one-off prompts do not accumulate."""

    FORGET = 0.01
    SWEEP = 4096

    def __init__(self, half_life_s: float = 30.0) -> None:
        self.rate = math.log(2) / half_life_s
        self._values: dict[int, tuple[float, float]] = {}  # key -> (count, at)
        self._total = (0.0, 0.0)
        self._adds = 0

    def _decayed(self, value: tuple[float, float], now: float) -> float:
        count, at = value
        return count * math.exp(-self.rate * max(0.0, now - at))

    def add(self, key: int, now: float) -> None:
        self._values[key] = (self.count(key, now) + 1.0, now)
        self._total = (self.total(now) + 1.0, now)
        self._adds += 1
        if self._adds % self.SWEEP == 0:
            for k in [k for k, v in self._values.items() if self._decayed(v, now) < self.FORGET]:
                del self._values[k]

    def count(self, key: int, now: float) -> float:
        value = self._values.get(key)
        return self._decayed(value, now) if value else 0.0

    def total(self, now: float) -> float:
        return self._decayed(self._total, now)

    def __len__(self) -> int:
        return len(self._values)
