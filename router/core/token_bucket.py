"""A token bucket: the one rate limiter behind per-tenant rate limits (router/flow/ratelimit.py)
and the answered refusals of a peer over its connection share (router/http/connections.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """Up to ``capacity`` tokens, refilled continuously at ``per_s`` a second; starts full.
    An amount over the capacity is taken as the whole capacity: it fits once the bucket is
    full (it could never fit otherwise)."""

    capacity: float
    per_s: float
    level: float = math.nan  # NaN until first used: full then
    at: float = 0.0

    def refill(self, now: float) -> float:
        """The level at ``now``."""
        if math.isnan(self.level):
            self.level, self.at = self.capacity, now
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now
        return self.level

    def wait_s(self, amount: float, now: float) -> float:
        """0 if ``amount`` fits now, else the seconds until it will."""
        need = min(amount, self.capacity)
        level = self.refill(now)
        return 0.0 if level >= need else (need - level) / self.per_s

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= min(amount, self.capacity)

    def try_take(self, amount: float, now: float) -> bool:
        """Take ``amount`` if it fits now."""
        if self.wait_s(amount, now) > 0:
            return False
        self.level -= min(amount, self.capacity)
        return True
