"""Fleet mode end to end: two or three in-process gateways sharing one real redis-server, in
front of simulated vLLM replicas, over real sockets.

Every wait polls an observable condition against a deadline (``tests.helpers.wait_for``).
The gateways here get a generous Redis lookup timeout (``redis_timeout_ms``): these tests check
what is shared, not latency, and a 10 ms timeout on a loaded 2-core box would now and then
answer a lookup from the local view and make an assertion about sharing flaky.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from router.index.redis import make_client
from router.schedule import HashRing
from router.schedule.policies import RecentCounts
from tests.helpers import LONG_SYSTEM, cached_tokens, chat_body, post, wait_for
from tests.redis_server import RedisServer

MODEL = "Qwen/Qwen3-0.6B"
PREFIX = "fleet-test"
CHAT = "/v1/chat/completions"
REPLICA_HDR = "x-prefix-router-replica"
BLOCKS_HDR = "x-prefix-router-cached-blocks"


@pytest.fixture
async def rclient(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = make_client(redis_server.url, socket_timeout=2.0, connect_timeout=1.0)
    yield client
    await client.aclose()


async def start_fleet_gateways(
    gateway: Any, urls: list[str], redis_url: str, n: int, **overrides: Any
) -> list[Any]:
    overrides.setdefault("redis_prefix", PREFIX)
    overrides.setdefault("sync_interval_s", 0.1)
    overrides.setdefault("redis_timeout_ms", 250.0)
    return [await gateway(urls, redis_url=redis_url, **overrides) for _ in range(n)]


def tenant_body(tenant: str, user: str, **extra: Any) -> dict[str, Any]:
    return chat_body(user, system=f"Tenant {tenant} system prompt. " + LONG_SYSTEM, **extra)


async def block_hashes(gw: Any, body: dict[str, Any]) -> list[int]:
    rr = await gw.gateway.path.prepare(json.dumps(body).encode(), {}, "chat", "test")
    return list(rr.block_hashes)


async def shared_match(gw: Any, hashes: list[int], urls: list[str]) -> dict[str, int]:
    """What Redis (not the gateway's local copy) says each replica holds."""
    return await gw.gateway.index.primary.match(hashes, urls)


async def background_done(*gws: Any) -> bool:
    """The Redis writes each gateway spawned off the request path have all finished, and
    the index writes they queued have been flushed."""
    return not any(
        gw.gateway._background or getattr(gw.gateway.index.primary, "pending", 0) for gw in gws
    )


async def explain(s: aiohttp.ClientSession, gw: Any, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(gw.url + "/v1/route/explain", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def metric(s: aiohttp.ClientSession, gw: Any, name: str) -> float:
    async with s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def reported_cached(body: dict[str, Any]) -> int:
    """cached_tokens, 0 when the replica omits prompt_tokens_details (vLLM does on a miss)."""
    details = body["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def remote_inflight(gw: Any) -> dict[str, int]:
    return {u: r.remote_inflight for u, r in gw.gateway.fleet.replicas.items()}


async def settle(rclient: Redis, *gws: Any) -> None:
    """Wait until every gateway has published an idle entry and every gateway has read the
    others' since, so no gateway still sees load from a finished request (remote load lags by
    up to a publish plus a read interval, and bounded loads would divert a cold prefix)."""

    async def published_idle() -> bool:
        raws = await rclient.mget([gw.gateway.sync.own_key for gw in gws])
        return all(
            raw is not None and not any(a or b for a, b in json.loads(raw)["load"].values())
            for raw in raws
        )

    await wait_for(published_idle, what="idle entries from every gateway")
    marks = [gw.gateway.sync.ticks for gw in gws]

    async def all_read() -> bool:  # tick m+1 began after the check, so m+2 means it finished
        return all(gw.gateway.sync.ticks >= m + 2 for gw, m in zip(gws, marks, strict=True))

    await wait_for(all_read, what="a full sync tick on every gateway")
    for gw in gws:
        assert not any(remote_inflight(gw).values())


# ---------------------------------------------------------------------------------------------


async def test_prefix_learned_on_one_gateway_is_routed_alike_by_another(
    fleet, gateway, redis_server
):
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    g1, g2 = await start_fleet_gateways(gateway, urls, redis_server.url, 2)
    first = tenant_body("shared", "What is the refund policy for annual plans?")
    second = tenant_body("shared", "And how do I change my billing address?")
    hashes = await block_hashes(g1, first)
    shared_blocks = len(await block_hashes(g1, tenant_body("shared", "")))
    async with aiohttp.ClientSession() as s:
        status, h1, _ = await post(s, g1.url + CHAT, first)
        assert status == 200
        owner = h1[REPLICA_HDR]
        assert h1[BLOCKS_HDR] == "0"

        async def in_redis() -> bool:
            return (await shared_match(g2, hashes, urls)).get(owner) == len(hashes)

        await wait_for(in_redis, what="gateway 1's record in Redis")
        assert g2.gateway.index.local.size(owner) == 0  # gateway 2 never saw it itself

        status, h2, b2 = await post(s, g2.url + CHAT, second)
        assert status == 200
    assert h2[REPLICA_HDR] == owner
    predicted = int(h2[BLOCKS_HDR])
    assert predicted >= shared_blocks - 1 > 0  # the shared system prompt, from Redis
    assert cached_tokens(b2) == predicted * 16  # and the replica reused exactly that
    assert g2.gateway.index.fallbacks == 0


async def test_cold_prefixes_land_on_the_ring_owner_via_any_gateway(
    fleet, gateway, redis_server, rclient
):
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    # No replica scrapes after start-up: a scrape caught mid-request would count as load.
    gws = await start_fleet_gateways(gateway, urls, redis_server.url, 3, metrics_interval_s=60)
    for gw in gws:
        await wait_for(lambda gw=gw: _ring_is(gw, urls), what="every replica on every ring")
    reference = HashRing(urls, virtual_nodes=gws[0].gateway.config.routing.virtual_nodes)
    landed: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            body = tenant_body(f"cold-{i}", "hello")
            await settle(rclient, *gws)
            views = [await explain(s, gw, body) for gw in gws]
            owner = next(reference.walk(int(views[0]["block_hashes"][0], 16)))
            for v in views:
                assert v["decision"]["reason"] == "ring", v["decision"]
                assert v["decision"]["ring_choice"] == owner
                assert v["decision"]["replica"] == owner
            status, h, _ = await post(s, gws[i % 3].url + CHAT, body)
            assert status == 200
            assert h[REPLICA_HDR] == owner
            assert h[BLOCKS_HDR] == "0"
            landed[owner] += 1
    assert len(landed) >= 2, landed  # distinct prefixes do spread over the ring


async def _ring_is(gw: Any, urls: list[str]) -> bool:
    return set(gw.gateway.ring.members) == set(urls)


async def test_killed_gateway_leaves_no_phantom_load(fleet, gateway, redis_server, rclient):
    # Slow decoding: the requests stay in flight for many seconds (they are cancelled below).
    replicas = await fleet(2, decode_tokens_per_s=10)
    urls = [r.url for r in replicas]
    victim, survivor = await start_fleet_gateways(gateway, urls, redis_server.url, 2)
    n = 6
    async with aiohttp.ClientSession() as s:
        inflight = [
            asyncio.create_task(
                post(s, victim.url + CHAT, tenant_body(f"slow-{i}", "tell me", max_tokens=500))
            )
            for i in range(n)
        ]
        try:

            async def survivor_sees_them() -> bool:
                return sum(remote_inflight(survivor).values()) == n

            await wait_for(survivor_sees_them, what="the victim's load on the survivor")
            assert victim.gateway.sync.gateway_id in survivor.gateway.sync.peers

            # The crash: the victim stops publishing and withdraws nothing.
            await victim.gateway.sync.stop(withdraw=False)
            own_key = victim.gateway.sync.own_key
            assert await rclient.exists(own_key) == 1

            async def phantom_gone() -> bool:
                return not any(remote_inflight(survivor).values())

            await wait_for(phantom_gone, timeout=5.0, what="the victim's load to expire")
            # Its requests are all still running: the load went away because the entry
            # expired (TTL 3 x sync interval), not because the requests finished.
            assert not any(t.done() for t in inflight)
            assert sum(r.inflight for r in victim.gateway.fleet.replicas.values()) == n
            assert await rclient.exists(own_key) == 0
            assert victim.gateway.sync.gateway_id not in survivor.gateway.sync.peers
            assert set(survivor.gateway.ring.members) == set(urls)
        finally:
            for t in inflight:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)


async def test_redis_killed_mid_load_loses_no_request_and_recovers(
    fleet, gateway, redis_server, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="router.index.resilient")

    def outages() -> list[str]:
        return [m for r in caplog.records if "index unavailable" in (m := r.getMessage())]

    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    gws = await start_fleet_gateways(gateway, urls, redis_server.url, 2)
    g1, g2 = gws
    statuses: collections.Counter[int] = collections.Counter()
    done = 0
    stop = asyncio.Event()

    async def worker(s: aiohttp.ClientSession, w: int) -> None:
        nonlocal done
        i = 0
        while not stop.is_set():
            gw = gws[(w + i) % 2]  # per request: consecutive turns alternate gateways
            status, _, _ = await post(s, gw.url + CHAT, tenant_body(f"load-{w % 3}", f"q {w} {i}"))
            statuses[status] += 1
            done += 1
            i += 1

    async def completed(n: int) -> None:
        target = done + n

        async def reached() -> bool:
            return done >= target

        await wait_for(reached, timeout=15.0, what=f"{n} more requests")

    async with aiohttp.ClientSession() as s:
        workers = [asyncio.create_task(worker(s, w)) for w in range(6)]
        try:
            await completed(20)
            redis_server.kill()

            async def both_down() -> bool:
                return all(not gw.gateway.index.redis_up for gw in gws)

            await wait_for(both_down, what="both gateways to fail over to their local view")
            await completed(20)  # served while Redis is gone
            await asyncio.to_thread(redis_server.start)  # same port, empty dataset

            async def both_up() -> bool:
                return all([await metric(s, gw, "prefix_router_redis_up") == 1 for gw in gws])

            await wait_for(both_up, what="prefix_router_redis_up back to 1")
            outages_before_recovery = len(outages())
            await completed(20)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        assert set(statuses) == {200}, statuses
        # A late timeout may have re-opened the circuit (allowed below): let it close again.
        await wait_for(both_up, timeout=30.0, what="prefix_router_redis_up back to 1 at the end")
        # Down once and up once, no flapping: connections pooled before the outage must not
        # be handed out again after it (each would fail a call and re-open the circuit).
        # A starved CPU can make a call miss its deadline after recovery and re-open the
        # circuit once more; that is a timeout, never a connection error.
        for gw in gws:
            assert gw.gateway.index.transitions % 2 == 0  # ends up, as it went down
        assert outages_before_recovery >= 2  # each gateway saw the kill
        later = outages()[outages_before_recovery:]
        assert [m for m in later if not re.search(r"timed out|slower than|Timeout", m)] == []

        # Shared state works again: a prefix learned via gateway 1 is predicted by gateway 2.
        await wait_for(lambda: background_done(g1, g2), timeout=30.0, what="pending Redis writes")
        body = tenant_body("after-recovery", "first turn")
        hashes = await block_hashes(g1, body)
        status, h1, _ = await post(s, g1.url + CHAT, body)
        assert status == 200
        owner = h1[REPLICA_HDR]

        async def in_redis() -> bool:
            return (await shared_match(g2, hashes, urls)).get(owner) == len(hashes)

        await wait_for(in_redis, what="the new record in the restarted Redis")
        # The load phase sent dozens of requests to a few replicas; how many depends on the
        # machine's speed, and past SHARE_MIN_RECENT the share-of-recent-requests bound may
        # spill the next one. That bound is tested elsewhere: start this check from a clean
        # slate so it tests only what Redis shares.
        for gw in gws:
            gw.gateway.policy.recent = RecentCounts()
        status, h2, b2 = await post(s, g2.url + CHAT, tenant_body("after-recovery", "second"))
    assert status == 200
    assert h2[REPLICA_HDR] == owner
    assert int(h2[BLOCKS_HDR]) > 0
    assert cached_tokens(b2) == int(h2[BLOCKS_HDR]) * 16
    assert g2.gateway.index.redis_up


async def test_redis_keys_stay_within_capacity_and_namespace(fleet, gateway, redis_server, rclient):
    replicas = await fleet(2)
    urls = [r.url for r in replicas]
    gws = await start_fleet_gateways(
        gateway, urls, redis_server.url, 2, capacity_blocks=64, redis_prefix="cap-ns"
    )
    sent: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as s:
        for batch in range(4):
            results = await asyncio.gather(
                *(
                    post(s, gws[i % 2].url + CHAT, tenant_body(f"cap-{batch}-{i}", "hi"))
                    for i in range(6)
                )
            )
            for status, h, _ in results:
                assert status == 200
                sent[h[REPLICA_HDR]] += 1
    await wait_for(lambda: background_done(*gws), what="pending Redis writes")
    blocks_per_prompt = len(await block_hashes(gws[0], tenant_body("cap-0-0", "hi")))
    assert blocks_per_prompt * max(sent.values()) > 64  # more than fits was recorded

    index = gws[0].gateway.index.primary
    cards = {u: await rclient.zcard(index.blocks_key(u)) for u in urls}
    assert all(c <= 64 for c in cards.values()), cards
    busiest = max(sent, key=sent.__getitem__)
    assert cards[busiest] == 64, cards  # trimmed to exactly the capacity
    for u in urls:
        if sent[u]:  # the capacity is stored in the model's map, under the replica's id
            assert int(await rclient.hget(index.map_key(u), b"c" + index.rid(u))) == 64

    keys = [k.decode() for k in await rclient.keys("*")]
    tag = "{" + MODEL + "}"
    # The model's index under its own tag (one Cluster slot); what the gateways share about
    # the fleet as a whole (load, ring members) under the fleet's.
    index_keys = [k for k in keys if ":blocks:" in k or k.endswith(":map")]
    assert index_keys and all(k.startswith(f"cap-ns:{tag}:") for k in index_keys), keys
    assert all(k.startswith("cap-ns:{fleet}:") for k in set(keys) - set(index_keys)), keys
    assert len({key_slot(k.encode()) for k in index_keys}) == 1  # one hash tag, one slot
    for u in sent:
        assert f"cap-ns:{tag}:blocks:{u}" in keys
    assert f"cap-ns:{tag}:map" in keys
    assert {k.split(":", 3)[2] for k in keys} >= {"blocks", "map", "gw", "gateways"}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_unreachable_redis_at_startup_routes_on_the_local_view(fleet, gateway):
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    gw = await gateway(urls, redis_url=f"redis://127.0.0.1:{_closed_port()}/0", sync_interval_s=0.1)
    seen = []
    async with aiohttp.ClientSession() as s:
        assert await metric(s, gw, "prefix_router_redis_up") == 0
        for i in range(8):
            status, h, b = await post(s, gw.url + CHAT, tenant_body("local", f"question {i}"))
            assert status == 200, b
            seen.append((h[REPLICA_HDR], int(h[BLOCKS_HDR]), reported_cached(b)))
        assert await metric(s, gw, "prefix_router_redis_up") == 0
        assert await metric(s, gw, "prefix_router_redis_fallbacks_total") >= 8
    assert len({r for r, _, _ in seen}) == 1, seen  # same prefix, same replica
    for _, predicted, reported in seen[1:]:
        assert predicted > 0
        assert reported == predicted * 16
    assert gw.gateway.sync.members is None  # the ring is this gateway's own healthy set
    assert set(gw.gateway.ring.members) == set(urls)
