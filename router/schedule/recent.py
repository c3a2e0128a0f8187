"""Requests placed on each replica lately: the history the share bound and the placement of
a prefix nobody holds read."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

# When a replica counts as among the least recently busy (``least_recent``): the prefill work
# placed on it lately (uncached prompt tokens, decayed) is at most ``RECENT_RATIO`` x the
# least, or it took at most ``RECENT_FLOOR`` requests lately.
RECENT_RATIO = 1.25
RECENT_FLOOR = 4.0


class RecentCounts:
    """Requests routed to each replica and the prefill work they brought (uncached prompt
    tokens), exponentially decayed (half-life ``half_life_s``)."""

    def __init__(
        self, half_life_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._values: dict[str, tuple[float, float, float]] = {}  # url -> (count, work, at)

    def _now(self, url: str, now: float) -> tuple[float, float]:
        count, work, at = self._values.get(url, (0.0, 0.0, now))
        decay = math.exp(-self.rate * (now - at))
        return count * decay, work * decay

    def add(self, url: str, work: float = 0.0) -> None:
        now = self.clock()
        count, before = self._now(url, now)
        self._values[url] = (count + 1.0, before + work, now)

    def counts(self, urls: Sequence[str]) -> dict[str, float]:
        now = self.clock()
        return {u: self._now(u, now)[0] for u in urls}

    def both(self, urls: Sequence[str]) -> dict[str, tuple[float, float]]:
        """url -> (requests, work)."""
        now = self.clock()
        return {u: self._now(u, now) for u in urls}


def least_recent(order: Sequence[str], recent: Mapping[str, tuple[float, float]]) -> list[str]:
    """Those of ``order`` (a prefix's ring order, kept) whose recent work is at most
    ``RECENT_RATIO`` x the least, or that took at most ``RECENT_FLOOR`` requests lately.
    Compared coarsely on purpose: on an idle or evenly loaded fleet every replica qualifies
    and the caller's next criteria (in flight, ring order) decide as before, alike on every
    gateway (fleet mode: each gateway counts only its own placements, so their exact counts
    differ, and a few requests more is noise, not load); a replica is passed over only when
    it took clearly more work than the least lately (two tenants' where another took one).
    Work, not requests: a tenant's first request brings its uncached system prompt, so the
    work also tells how many tenants a replica took lately, not only how often they sent."""
    least = RECENT_RATIO * min(recent[u][1] for u in order)
    return [u for u in order if recent[u][1] <= least or recent[u][0] <= RECENT_FLOOR]


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
