"""The one token bucket behind tenants' rate limits and a peer's answered refusals."""

from __future__ import annotations

import pytest

from router.core.token_bucket import TokenBucket
from router.flow.ratelimit import Bucket


def test_starts_full_then_refills_at_its_rate() -> None:
    b = TokenBucket(capacity=3.0, per_s=2.0)
    assert [b.try_take(1.0, now=10.0) for _ in range(4)] == [True, True, True, False]
    assert b.wait_s(1.0, now=10.0) == pytest.approx(0.5)
    assert not b.try_take(1.0, now=10.25)
    assert b.try_take(1.0, now=10.5)
    assert b.refill(now=100.0) == 3.0  # never above its capacity


def test_an_amount_over_the_capacity_fits_once_full() -> None:
    b = TokenBucket(capacity=2.0, per_s=1.0)
    assert b.try_take(5.0, now=0.0)
    assert b.wait_s(5.0, now=0.0) == pytest.approx(2.0)  # the whole capacity, not 5


def test_a_per_minute_limit_and_its_headers() -> None:
    b = Bucket(60)  # one a second
    b.take(30, now=0.0)
    assert b.wait_s(31, now=0.0) == pytest.approx(1.0)
    assert b.headers("requests", now=0.0) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "30",
        "x-ratelimit-reset-requests": "30.000s",
    }
