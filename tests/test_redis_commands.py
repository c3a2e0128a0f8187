"""Fleet mode's Redis cost per request, counted by Redis itself (``INFO commandstats``, which
counts the commands scripts run too) and by the gateway's sockets (round trips)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from redis.asyncio import Connection

from router.index.redis import make_client
from tests.helpers import LONG_SYSTEM, chat_body, post, wait_for
from tests.redis_server import RedisServer

CHAT = "/v1/chat/completions"


class Sends:
    """Counts the gateway's writes to its Redis sockets: one per command or pipeline sent,
    that is one per round trip."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        send = Connection.send_packed_command

        async def counted(conn: Connection, command: Any, check_health: bool = True) -> None:
            self.count += 1
            await send(conn, command, check_health)

        monkeypatch.setattr(Connection, "send_packed_command", counted)


async def test_a_request_costs_one_round_trip_and_at_most_three_commands(
    fleet, gateway, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 chats over 5 tenants' long system prompts through one gateway on two replicas (the
    issue's measurement: 25 commands a request with a sorted set per replica). The sync tick
    and the periodic flush are slowed past the run, so what Redis counts is the requests' own
    work: the flush at the end sends their writes in one batch."""
    replicas = await fleet(2, instant=True)
    gw = await gateway(
        [r.url for r in replicas],
        redis_url=redis_server.url,
        redis_prefix="cost",
        redis_timeout_ms=500.0,
        sync_interval_s=60.0,
        redis_flush_ms=60_000.0,
    )
    index = gw.gateway.index
    bodies = [
        chat_body(
            f"Question {i // 5} from tenant {i % 5}?", system=f"Tenant {i % 5}. {LONG_SYSTEM}"
        )
        for i in range(55)
    ]
    client = make_client(redis_server.url)

    async def flushed() -> bool:
        return (
            not gw.gateway._background
            and await index.flush()
            and not getattr(index.primary, "pending", 0)
        )

    try:
        async with aiohttp.ClientSession() as s:
            for body in bodies[:5]:  # warm-up: each tenant's prefix placed and flushed
                assert (await post(s, gw.url + CHAT, body))[0] == 200
            await wait_for(flushed, what="the warm-up's writes flushed")
            await client.config_resetstat()
            sends = Sends(monkeypatch)
            for body in bodies[5:]:
                assert (await post(s, gw.url + CHAT, body))[0] == 200
            on_path = sends.count
            await wait_for(flushed, what="the requests' writes flushed")
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    for admin in ("info", "config|resetstat"):
        calls.pop(admin, None)
    requests = len(bodies) - 5
    assert on_path == requests, (on_path, calls)  # the match, nothing else
    assert calls["evalsha"] == requests + 1, calls  # the matches, then one batch
    assert calls["hmget"] == requests + 1, calls  # each script's one read
    assert sum(calls.values()) <= 3 * requests, calls
    assert index.fallbacks == 0
