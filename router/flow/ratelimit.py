"""Per-tenant request and token rate limits (per minute), as token buckets, with the rate-limit
headers OpenAI's API sends (``x-ratelimit-limit-requests`` ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Bucket:
    """``limit`` per minute, refilled continuously; starts full."""

    limit: int
    level: float = math.nan
    at: float = 0.0

    def _refill(self, now: float) -> None:
        if math.isnan(self.level):
            self.level, self.at = float(self.limit), now
        self.level = min(float(self.limit), self.level + (now - self.at) * self.limit / 60.0)
        self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 if ``amount`` fits now, else the seconds until it will. An amount larger than
        the whole limit fits once the bucket is full (it could never fit otherwise)."""
        self._refill(now)
        need = min(amount, float(self.limit))
        return 0.0 if self.level >= need else (need - self.level) * 60.0 / self.limit

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= min(amount, float(self.limit))

    def headers(self, kind: str, now: float) -> dict[str, str]:
        self._refill(now)
        reset = (self.limit - self.level) * 60.0 / self.limit
        return {
            f"x-ratelimit-limit-{kind}": str(self.limit),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": f"{max(0.0, reset):.3f}s",
        }


@dataclass
class TenantLimits:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    headers: dict[str, str] = field(default_factory=dict)


class RateLimiter:
    """Buckets per tenant, rebuilt when the tenant's limits change (a reloaded keys file)."""

    def __init__(self, max_tenants: int = 100_000) -> None:
        self._tenants: dict[str, tuple[tuple[int | None, int | None], TenantLimits]] = {}
        self.max_tenants = max_tenants

    def check(
        self, tenant: str, rpm: int | None, tpm: int | None, tokens: int, now: float
    ) -> tuple[float, str | None, dict[str, str]]:
        """(seconds to wait, which limit, headers). On 0 s the request is counted."""
        if rpm is None and tpm is None:
            return 0.0, None, {}
        key = (rpm, tpm)
        found = self._tenants.get(tenant)
        if found is None or found[0] != key:
            if len(self._tenants) >= self.max_tenants:
                self._tenants.clear()  # bounded: a full table forgets (and refills) everyone
            limits = TenantLimits(Bucket(rpm) if rpm else None, Bucket(tpm) if tpm else None)
            self._tenants[tenant] = (key, limits)
        else:
            limits = found[1]
        waits = []
        if limits.requests is not None:
            waits.append((limits.requests.wait_s(1, now), "requests"))
        if limits.tokens is not None:
            waits.append((limits.tokens.wait_s(tokens, now), "tokens"))
        wait, which = max(waits)
        if wait <= 0:
            if limits.requests is not None:
                limits.requests.take(1, now)
            if limits.tokens is not None:
                limits.tokens.take(tokens, now)
        headers: dict[str, str] = {}
        if limits.requests is not None:
            headers.update(limits.requests.headers("requests", now))
        if limits.tokens is not None:
            headers.update(limits.tokens.headers("tokens", now))
        return wait, (which if wait > 0 else None), headers
