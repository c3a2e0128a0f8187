"""Retries before the first byte as a budget, over real sockets: simulated replicas too slow
to answer within the first-byte timeout (every one saturated), and a replica that is gone
(connection refused). A request that may have reached a replica is not sent again while the
fleet is saturated or past the retry budget (a 503 in the API's shape, not a request computed
twice); one that never reached a replica still fails over."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.helpers import LONG_SYSTEM, chat_body, post

SLOW = {"prefill_tokens_per_s": 100.0}  # ~4 s per request: every first byte times out


def unique(i: int) -> dict[str, Any]:
    """A prompt sharing no cached prefix with another (each one is all prefill)."""
    return chat_body(f"question {i}", system=f"Request {i}. {LONG_SYSTEM}")


TIMEOUTS = {"first_byte_timeout_s": 0.3, "first_byte_timeout_floor_s": 0.1}


# Outlier ejection off: the retries alone decide what the replicas receive.
NO_EJECTION = {"eject_after_failures": 1000, "outlier_min_requests": 1000}


async def send_20(fleet: Any, gateway: Any, **config: Any) -> tuple[list[Any], int, str]:
    """20 requests at once on two saturated replicas, each timing out before its first
    byte: their answers, how many requests the replicas received, the gateway's metrics."""
    replicas = await fleet(2, **SLOW)
    gw = await gateway([r.url for r in replicas], **TIMEOUTS, **NO_EJECTION, **config)
    async with aiohttp.ClientSession() as http:
        url = gw.url + "/v1/chat/completions"
        results = await asyncio.gather(*(post(http, url, unique(i)) for i in range(20)))
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    for status, _, err in results:
        assert status in (502, 503), err
        assert err["error"]["code"] in (
            "fleet_saturated",
            "upstream_unavailable",
            "upstream_failed",
        )
    return results, sum(r.stats["requests"] for r in replicas), metrics


async def test_first_byte_timeouts_are_not_resent_beyond_the_retry_budget(
    fleet: Any, gateway: Any
) -> None:
    """Without flow control. Before, every timeout was sent again to the other replica: 40
    deliveries, each request computed twice. Now a re-send takes one of the budget's
    retries (at least 3; 20% of the 20 in flight = 4), and a timeout while the other
    replica reports a queue of its own (its scraped gauge) is not re-sent at all."""
    _, delivered, metrics = await send_20(fleet, gateway)
    assert 20 <= delivered <= 24, delivered
    assert "prefix_router_retries_shed_total{" in metrics


async def test_no_timeout_resend_while_flow_control_holds_requests(
    fleet: Any, gateway: Any
) -> None:
    """Flow control on, and a budget that would allow every retry: a timeout while
    requests wait in the gateway (or no prefill slot is free) is shed with a 503
    fleet_saturated, not sent to the next replica ahead of them. At most the last one,
    timing out once a slot is free again, goes to another replica. Before: 40."""
    results, delivered, _ = await send_20(
        fleet,
        gateway,
        flow_control=True,
        tenant_header="X-Tenant",
        retry_budget_percent=100.0,
        retry_budget_min_concurrency=20,
    )
    assert 20 <= delivered <= 21, delivered
    assert sum(err["error"]["code"] == "fleet_saturated" for _, _, err in results) >= 19


async def test_a_connection_refused_fails_over_even_with_no_retry_budget(
    fleet: Any, gateway: Any
) -> None:
    """A replica that went away after the gateway saw it healthy: requests placed there are
    refused at connect and go to the other replica, though the budget allows no retry at
    all (a request that never reached a replica cannot be computed twice)."""
    gone, live = await fleet(2)
    gw = await gateway(
        [gone.url, live.url],
        policy="round_robin",
        health_interval_s=60.0,
        retry_budget_percent=0.0,
        retry_budget_min_concurrency=0,
    )
    await gone.stop()
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            status, _, body = await post(
                http, gw.url + "/v1/chat/completions", chat_body(f"question {i}")
            )
            assert status == 200, body
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert live.stats["requests"] == 4
    assert 'why="connect' in metrics  # at least one went to the gone replica first
