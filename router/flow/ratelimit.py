"""Per-tenant request and token rate limits (per minute), as token buckets, with the rate-limit
headers OpenAI's API sends (``x-ratelimit-limit-requests`` ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.core.token_bucket import TokenBucket


class Bucket(TokenBucket):
    """``limit`` per minute, refilled continuously; starts full."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__(float(limit), limit / 60.0)
        self.limit = limit

    def headers(self, kind: str, now: float) -> dict[str, str]:
        level = self.refill(now)
        reset = (self.limit - level) / self.per_s
        return {
            f"x-ratelimit-limit-{kind}": str(self.limit),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(level))),
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
        return self._check(tenant, rpm, tpm, tokens, now, take=True)

    def peek(
        self, tenant: str, rpm: int | None, tpm: int | None, tokens: int, now: float
    ) -> tuple[float, str | None, dict[str, str]]:
        """``check`` without counting anything: whether a request of at least ``tokens``
        could pass now (before its prompt is rendered; ``check`` counts it after)."""
        return self._check(tenant, rpm, tpm, tokens, now, take=False)

    def _check(
        self, tenant: str, rpm: int | None, tpm: int | None, tokens: int, now: float, take: bool
    ) -> tuple[float, str | None, dict[str, str]]:
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
        if wait <= 0 and take:
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
