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
