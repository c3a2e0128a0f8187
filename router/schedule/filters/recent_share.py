"""Bounded share of recent requests: a popular tenant at light load never builds a queue,
yet would otherwise take most of the fleet's traffic."""

from __future__ import annotations

from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.types import Cycle, Filter

# The share bound applies once the fleet has recently taken this many requests per replica
# (decayed, half-life 10 s: about 1.1 request/s per replica sustained). Below that, a popular
# prefix simply sticks: nothing queues, and spreading it would only cost cache hits.
SHARE_MIN_RECENT = 16


@registry.filter("recent_share")
class RecentShare(Filter):
    """Invariant: once the candidates have recently taken at least ``min_recent`` requests
    each on average, one whose decayed count, plus this one, exceeds
    ``load_bound x (total + 1) / n + 1`` is removed. Below that nothing is removed."""

    @dataclass(frozen=True)
    class Params:
        load_bound: float = 1.25
        min_recent: float = SHARE_MIN_RECENT

        def __post_init__(self) -> None:
            if self.load_bound < 1.0:
                raise ValueError(f"load_bound must be >= 1.0, got {self.load_bound}")

    name = "recent_share"
    exact_on_head = True  # never reads the prompt length
    reason = "over its share of recent requests"
    uses_recent = True

    def __init__(self, params: Params) -> None:
        self.p = params

    def remove(self, cycle: Cycle) -> set[str]:
        urls = [c.url for c in cycle.candidates]
        recent = cycle.recent.counts(urls)
        total = sum(recent.values())
        if total < self.p.min_recent * len(urls):  # a few requests, not sustained traffic
            return set()
        bound = self.p.load_bound * (total + 1) / len(urls) + 1
        return {u for u in urls if recent[u] + 1 > bound}
