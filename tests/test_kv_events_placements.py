"""Precise mode keeps the index to what the events say: the gateway's own placement records
are retracted when the events never confirm them, and a batch of evictions costs one write.

Real ZMQ sockets to simulated replicas, a real redis-server in fleet mode; the truth is the
simulator's block pool (``tests.test_kv_events.truth``).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from router.index.redis import make_client
from router.kv_events.placements import Placements
from tests.helpers import post, wait_for
from tests.test_kv_events import (
    body,
    fleet_gateways,
    fleet_settled,
    held,
    mixed,
    one_owner_each,
    send,
    settled,
    shared,
    shared_settled,
    start,
    truth,
)


async def prompt_blocks(gw: Any, b: dict[str, Any]) -> set[int]:
    rr = await gw.gateway.path.prepare(json.dumps(b).encode(), {}, "chat", "test")
    return set(rr.block_hashes)


async def fail_requests(session: aiohttp.ClientSession, gws: list[Any], replicas: list[Any]):
    """Each replica fails its next two requests with a 500 before computing anything (an
    engine error): the gateway placed their blocks, and no event will ever store them."""
    for r in replicas:
        r.faults.fail_next(2, 500)
    bodies = []
    for i in range(40):
        if all(r.stats["injected_failures"] == 2 for r in replicas):
            break
        b = body(500 + i)
        status, _, _ = await post(session, gws[i % len(gws)].url + "/v1/chat/completions", b)
        if status == 500:
            bodies.append(b)
    assert len(bodies) == 2 * len(replicas)
    return bodies


async def test_placements_the_events_never_confirm_are_retracted(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, n=1, num_gpu_blocks=120)
    (r,) = replicas
    stream = sub.streams[r.url]
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(24))
        await settled(gw, replicas)
        assert r.engine.pool.evictions > 0
        assert held(gw, r.url) == truth(r)
        failed = await fail_requests(session, [gw], replicas)
        await send(session, gw.url, mixed(8, offset=40))  # and traffic after them
        await settled(gw, replicas)
    placed_only: set[int] = set()
    for b in failed:
        placed_only |= await prompt_blocks(gw, b)
    assert not placed_only & truth(r)  # the replica never computed them

    # Settled at the outcome (~1 s) or, for a placement no outcome settled, timeout_s (10 s)
    # after it: either way retracted, where without the check it would stay until LRU.
    await sub.wait(lambda: held(gw, r.url) == truth(r), timeout=30.0)
    assert not placed_only & held(gw, r.url)
    assert stream.placements.retracted >= len(placed_only)
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert f'prefix_router_kv_event_stream_owned{{replica="{r.url}"}} 1.0' in text
    line = f'prefix_router_kv_events_retracted_blocks_total{{replica="{r.url}"}}'
    assert float(text.split(line)[1].split()[0]) >= len(placed_only)
    # Evictions come one BlockRemoved per block; a batch writes them as one forget.
    kinds = [[kind for kind, _ in ops] for _, ops in stream.oplog]
    assert not any(a == b == "forget" for ks in kinds for a, b in zip(ks, ks[1:], strict=False))
    assert any(len(arg) > 1 for _, ops in stream.oplog for kind, arg in ops if kind == "forget")


async def test_fleet_mode_local_and_shared_index_equal_the_caches_after_failures(
    fleet, gateway, redis_server
):
    replicas, gws = await fleet_gateways(fleet, gateway, redis_server, n_gw=2, num_gpu_blocks=150)
    await one_owner_each(gws, replicas)
    client = make_client(redis_server.url, socket_timeout=2.0, connect_timeout=1.0)
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(0, 32, 4):
                await send(session, gws[(i // 4) % 2].url, mixed(4, offset=i))
            await fail_requests(session, gws, replicas)
            await send(session, gws[0].url, mixed(8, offset=60))
        await fleet_settled(gws, replicas)
        await shared_settled(client, gws, replicas)
        assert all(r.engine.pool.evictions > 0 for r in replicas)

        async def exact() -> bool:
            for r in replicas:
                want = truth(r)
                if await shared(client, gws[0], r.url) != want:
                    return False
                if any(g.gateway.index.inner.local.blocks(r.url) != want for g in gws):
                    return False
            return True

        # Timeout-path placements (10 s) and, after a Redis blip, the lease owner's rewrite
        # of the shared entry both converge; neither within the default 10 s.
        await wait_for(
            exact, timeout=40.0, what="every local view and Redis equal to the replicas' caches"
        )

        async def one_owned_gauge_each() -> bool:
            texts = []
            async with aiohttp.ClientSession() as session:
                for g in gws:
                    async with session.get(g.url + "/metrics") as resp:
                        texts.append(await resp.text())
            gauge = 'prefix_router_kv_event_stream_owned{{replica="{}"}} {}'
            return all(
                [gauge.format(r.url, "1.0") in t for t in texts].count(True) == 1
                and [gauge.format(r.url, "0.0") in t for t in texts].count(True) == 1
                for r in replicas
            )

        await wait_for(one_owned_gauge_each, what="one gateway reporting each stream as owned")
    finally:
        await client.aclose()


def test_a_settled_placement_is_due_sooner_and_the_limit_checks_the_soonest_first():
    p = Placements()
    a, b, c = [1, 2], [3], [4, 5, 6]
    p.add(10.0, a)
    p.add(10.0, b)
    p.add(20.0, c)
    assert p.settle(1.0, b) and not p.settle(1.0, [3])  # found by identity, not by value
    assert p.due(0.5, limit=100) == []
    assert p.due(1.0, limit=100) == [b]
    assert (p.blocks, len(p)) == (5, 2)
    assert p.due(0.0, limit=3) == [a]  # past the limit: checked early, soonest deadline first
    assert p.due(25.0, limit=100) == [c]
    assert (p.blocks, len(p)) == (0, 0)


def test_an_answer_settles_the_placements_of_its_prompts_prefixes():
    """A lazy head's record (the prompt's first blocks, a list of its own) is settled by the
    answer to the whole prompt, as the chained last hash names the whole prefix."""
    p = Placements()
    head, full, other = [1, 2], [1, 2, 3, 4], [7, 8]
    p.add(10.0, head)
    p.add(10.0, full)
    p.add(10.0, other)
    assert p.settle(1.0, full)
    assert sorted(p.due(1.0, limit=100)) == [head, full]
    assert p.due(10.0, limit=100) == [other]
