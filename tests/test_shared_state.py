"""FleetSync: gateways sharing load and replica health through a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.asyncio import Connection, Redis
from redis.crc import key_slot

from router.fleet.shared_state import FleetSync, Load, new_gateway_id
from router.index.redis import make_client, model_tag
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401  (fixture)

MODEL = "Qwen/Qwen3-8B"


class CountingConnection(Connection):
    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        await super().send_packed_command(command, check_health)


class Gateway:
    """The two callables a gateway hands to FleetSync, backed by mutable fields."""

    def __init__(self, load: Load, healthy: set[str]) -> None:
        self.load = load
        self.healthy = healthy

    def sync(self, client: Redis, gid: str, **kw: Any) -> FleetSync:
        kw.setdefault("interval_s", 0.05)
        return FleetSync(
            client, MODEL, gid, lambda: dict(self.load), lambda: set(self.healthy), **kw
        )


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    c = make_client(redis_server.url, socket_timeout=0.5, connect_timeout=0.2)
    yield c
    await c.aclose()


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    """Wait for ``cond`` (polled each few ms) with a deadline; return the time it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def test_gateways_see_each_others_load_and_members(client: Redis) -> None:
    ga = Gateway({"r1": (3, 100)}, {"r1", "r2"})
    gb = Gateway({"r1": (1, 10), "r2": (2, 20)}, {"r2", "r3"})
    a, b = ga.sync(client, "gw-a"), gb.sync(client, "gw-b")
    assert a.members is None and a.remote_load == {}  # not synced yet
    await a.start()
    await b.start()
    try:
        await eventually(
            lambda: (
                a.remote_load == {"r1": (1, 10), "r2": (2, 20)}
                and b.remote_load == {"r1": (3, 100)}
            )
        )
        assert a.peers == {"gw-b"} and b.peers == {"gw-a"}
        await eventually(lambda: a.members == b.members == {"r1", "r2", "r3"})

        ga.load = {"r1": (7, 700)}  # load changes propagate
        gb.healthy = set()
        await eventually(lambda: b.remote_load == {"r1": (7, 700)})
        await eventually(lambda: a.members == b.members == {"r1", "r2"})

        # a third gateway: remote load sums over the others
        gc = Gateway({"r1": (1, 1)}, set())
        c = gc.sync(client, "gw-c")
        await c.start()
        try:
            await eventually(lambda: a.remote_load == {"r1": (2, 11), "r2": (2, 20)})
            await eventually(lambda: c.remote_load == {"r1": (8, 710), "r2": (2, 20)})
        finally:
            await c.stop()
    finally:
        await a.stop()
        await b.stop()


async def test_crashed_gateway_vanishes_after_ttl(client: Redis) -> None:
    a = Gateway({"r1": (5, 50)}, {"r1"}).sync(client, "gw-a", interval_s=0.1, ttl_s=0.6)
    b = Gateway({}, {"r2"}).sync(client, "gw-b", interval_s=0.1, ttl_s=0.6)
    await a.start()
    await b.start()
    try:
        await eventually(lambda: b.remote_load == {"r1": (5, 50)} and b.members == {"r1", "r2"})
        await a.stop(withdraw=False)  # stops publishing, as if it crashed
        took = await eventually(lambda: b.remote_load == {} and b.members == {"r2"})
        assert took > 0.2  # it went by expiry, not at once
        assert b.peers == set()
        # and the registry forgets it
        await eventually(lambda: not b._known)
        assert await client.smembers(b.registry_key) == {b"gw-b"}
    finally:
        await b.stop()


async def test_graceful_stop_withdraws_at_once(client: Redis) -> None:
    a = Gateway({"r1": (5, 50)}, {"r1"}).sync(client, "gw-a", ttl_s=30)
    b = Gateway({}, set()).sync(client, "gw-b", ttl_s=30)
    await a.start()
    await b.start()
    try:
        await eventually(lambda: b.remote_load == {"r1": (5, 50)})
        await a.stop()
        took = await eventually(lambda: b.remote_load == {} and b.members == set())
        assert took < 5
        assert await client.exists(a.own_key) == 0
    finally:
        await b.stop()


async def test_one_round_trip_per_tick(redis_server: RedisServer) -> None:
    c = make_client(redis_server.url, connection_class=CountingConnection)
    try:
        a = Gateway({"r1": (1, 1)}, {"r1"}).sync(c, "gw-a")
        b = Gateway({"r1": (1, 1)}, {"r1"}).sync(c, "gw-b")
        for _ in range(3):  # warm up; each learns the other
            assert await a.tick() and await b.tick()
        assert a._known == ["gw-b"]
        for _ in range(5):
            n = CountingConnection.sends
            assert await a.tick()
            assert CountingConnection.sends - n == 1
        assert a.remote_load == {"r1": (1, 1)}
    finally:
        await c.aclose()


async def test_redis_down_keeps_view_then_falls_back(redis_server: RedisServer) -> None:
    c = make_client(redis_server.url, socket_timeout=0.3, connect_timeout=0.2)
    states: list[bool | None] = []
    a = Gateway({"r1": (4, 40)}, {"r1"}).sync(c, "gw-a", interval_s=0.05, ttl_s=5)
    b = Gateway({}, {"r2"}).sync(
        c,
        "gw-b",
        interval_s=0.05,
        ttl_s=5,
        max_staleness_s=0.5,
        on_tick=lambda s: states.append(s.redis_up),
    )
    try:
        await a.start()
        await b.start()
        await eventually(lambda: b.remote_load == {"r1": (4, 40)} and b.members == {"r1", "r2"})
        redis_server.kill()
        await eventually(lambda: b.redis_up is False)
        if time.monotonic() - (b.last_ok or 0) < 0.4:  # still within the staleness bound
            assert b.remote_load == {"r1": (4, 40)}
        await eventually(lambda: b.members is None)  # stale: caller routes on its own view
        assert b.remote_load == {} and b.peers == set()
        assert b.errors > 0

        redis_server.restart()  # empty: everyone re-publishes on the next tick
        await eventually(
            lambda: b.remote_load == {"r1": (4, 40)} and b.members == {"r1", "r2"}, timeout=10
        )
        assert b.redis_up is True
        assert states[-1] is True and False in states
    finally:
        await a.stop()
        await b.stop()
    await c.aclose()


async def test_callbacks_that_raise_do_not_break_ticks(client: Redis) -> None:
    def boom() -> Load:
        raise RuntimeError("boom")

    s = FleetSync(client, MODEL, "gw-x", boom, lambda: {"r1"}, on_tick=lambda _: 1 / 0)
    assert await s.tick()
    assert s.members == {"r1"}


async def test_fleet_keys_share_the_model_slot(client: Redis) -> None:
    syncs = [
        Gateway({"r": (1, 1)}, {"r"}).sync(client, new_gateway_id(), namespace="pr")
        for _ in range(3)
    ]
    for _ in range(2):
        for s in syncs:
            assert await s.tick()
    keys = [k async for k in client.scan_iter(match="*")]
    assert len(keys) == 4  # 3 gateway entries + the registry
    assert {key_slot(k) for k in keys} == {key_slot(f"{{{model_tag(MODEL)}}}".encode())}
    assert all(k.startswith(b"pr:{Qwen/Qwen3-8B}:") for k in keys)
    for s in syncs:
        assert 0 < await client.pttl(s.own_key) <= 1500
