"""Precise mode through faults, over real ZMQ sockets: requests the replica rejects (during and
after an outage of its publisher), an outage long enough for the approximate model to trim
the index, and replica restarts, including a new publisher whose sequence passes the old one
before the gateway sees any of it.

After each fault the gateway's prediction for every prompt probed equals what the simulated
replica's cache would hit (``BlockPool.lookup`` on its own hashes) and the index holds exactly
the cache's blocks (``tests.test_kv_events.truth``).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from loadtest.sim.kvcache import block_hashes
from router.core.blocks import continue_chain, root_hash
from router.index import MemoryIndex
from router.kv_events import Endpoints, KVEventSubscriber
from tests.helpers import post
from tests.test_kv_events import (
    BS,
    KV,
    FakePublisher,
    batch,
    body,
    endpoints,
    held,
    mixed,
    send,
    settled,
    stored,
    truth,
)


async def start(fleet, gateway, **sim: Any):
    (r,) = await fleet(1, **{**KV, **sim})
    gw = await gateway(
        [r.url],
        kv_events=True,
        kv_events_endpoints=endpoints([r]),
        kv_events_timeout_s=1.0,
        # The stream must notice restarts by itself: no help from the health checks or the
        # counters (the fleet's own restart signals).
        health_interval_s=60.0,
        metrics_interval_s=60.0,
    )
    sub = gw.gateway.kv_events
    stream = sub.streams[r.url]
    await sub.wait(lambda: stream.connected and stream.up)
    return r, gw, sub, stream


async def exact(gw: Any, r: Any, bodies: list[dict[str, Any]]) -> None:
    """The index is the replica's cache, and every probe predicts what the cache would hit."""
    sub = gw.gateway.kv_events
    await sub.wait(lambda: held(gw, r.url) == truth(r), timeout=20.0)
    assert gw.gateway.index.size(r.url) == len(truth(r)) == r.engine.pool.num_cached
    pool = r.engine.pool
    for b in bodies:
        rr = await gw.gateway.path.prepare(json.dumps(b).encode(), {}, "chat", "probe")
        predicted = (await gw.gateway.index.match(rr.block_hashes, [r.url]))[r.url]
        own = block_hashes(list(rr.token_ids), BS, lora=rr.lora, cache_salt=rr.cache_salt)
        assert predicted == len(pool.lookup(own, len(own))), b["messages"][0]["content"][:40]


async def reject(session: aiohttp.ClientSession, gw: Any, r: Any, bodies: list[dict[str, Any]]):
    r.fail_next(len(bodies), 400)
    for b in bodies:
        status, _, err = await post(session, gw.url + "/v1/chat/completions", b)
        assert status == 400, err


async def test_rejections_during_and_after_an_outage_leave_nothing_stale(fleet, gateway):
    r, gw, sub, stream = await start(fleet, gateway, num_gpu_blocks=120)
    await sub.wait(lambda: stream.capacity == 120)  # the approximate model's bound when down
    sent = mixed(10)
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, sent)
        await settled(gw, [r])
        await exact(gw, r, sent)

        # The publisher is cut off (the engine goes on numbering and buffering); requests go
        # on. The rejected ones are new prompts the approximate model records first, so it
        # trims the index to the replica's size in its own LRU order: blocks the replica
        # still holds go.
        await r.kv_events.pause()
        await sub.wait(lambda: not stream.up)
        before = held(gw, r.url)
        rejected = [body(900 + i) for i in range(8)]
        await reject(session, gw, r, rejected[:6])
        during = mixed(3, offset=40)
        await send(session, gw.url, during)
        await reject(session, gw, r, rejected[6:])
        assert (before & truth(r)) - held(gw, r.url)  # trimmed, though still held
        await r.kv_events.resume()
        await sub.wait(lambda: stream.up and stream.verified)
        await settled(gw, [r])
        await exact(gw, r, sent + during + rejected)
        assert stream.rebuilds >= 1 and stream.restarts == 0

        # A quiet replica rejects a request: its blocks go at once, and the stream stays up.
        await reject(session, gw, r, [body(950)])
        await exact(gw, r, sent + during + [body(950)])
        assert stream.up and stream.expect_since is None

        # A request that fails (a 500) and publishes nothing: the silence is asked about
        # through the replay socket, which answers, so the publisher is not marked down.
        replays = stream.replays
        r.fail_next(1, 500)
        status, _, _ = await post(session, gw.url + "/v1/chat/completions", body(960))
        assert status == 500
        await sub.wait(lambda: stream.replays > replays and stream.expect_since is None)
        assert stream.up
        await exact(gw, r, [body(960)])


async def test_restarts_resync_from_the_new_publishers_seq_0(fleet, gateway):
    """20 restarts: idle, with traffic through the gateway at once, and with the new engine's
    sequence passing the old one (traffic straight to the replica) before the gateway sees
    a message."""
    r, gw, sub, stream = await start(fleet, gateway, num_gpu_blocks=200)
    probes: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(6))
        await settled(gw, [r])
        for i in range(20):
            old_seq = r.kv_events.next_seq
            restarts = stream.restarts
            await r.stop()
            await r.start(port=r.port)  # a new process: empty cache, seq from 0, same ports
            bodies = mixed(3, offset=100 + 10 * i)
            if i % 3 == 2:  # the new sequence overtakes the old one, unseen by the gateway
                direct = mixed(old_seq + 2, offset=1000 + 50 * i)
                for b in direct:
                    status, _, _ = await post(session, r.url + "/v1/chat/completions", b)
                    assert status == 200
                assert r.kv_events.next_seq > old_seq
                bodies += direct[:3]
            if i % 3 == 1:  # idle after the restart: noticed with nothing published
                await sub.wait(lambda restarts=restarts: stream.restarts > restarts, timeout=20.0)
            await send(session, gw.url, bodies[:3])
            await r.wait_idle()
            # No explicit catch-up: the stream notices the restart by itself.
            last = r.kv_events.next_seq - 1
            await sub.wait(
                lambda restarts=restarts, last=last: (
                    stream.restarts > restarts and stream.last_applied == last
                ),
                timeout=20.0,
            )
            probes = probes[-20:] + bodies
            await exact(gw, r, probes)
    assert stream.errors.get("unknown_parent", 0) == 0


async def test_token_ids_outside_the_vocabulary_are_refused_before_anything_is_placed(
    fleet, gateway
):
    r, gw, sub, stream = await start(fleet, gateway, num_gpu_blocks=120)
    vocab = gw.gateway.renderer.vocab_size
    ok = list(range(100, 100 + 4 * BS))
    async with aiohttp.ClientSession() as session:
        for prompt in ([*ok, vocab], [ok, [vocab + 5]], [*ok, -1]):
            status, _, err = await post(
                session,
                gw.url + "/v1/completions",
                {"model": "Qwen/Qwen3-0.6B", "prompt": prompt, "max_tokens": 4},
            )
            assert status == 400, err
            assert err["error"]["type"] == "BadRequestError" and "vocabulary" in str(err)
        assert r.stats["requests"] == 0  # never forwarded
        assert len(stream.placements) == 0 and gw.gateway.index.size(r.url) == 0
        # The same ids within the vocabulary are served, placed and confirmed.
        status, _, _ = await post(
            session,
            gw.url + "/v1/completions",
            {"model": "Qwen/Qwen3-0.6B", "prompt": [*ok, vocab - 1], "max_tokens": 4},
        )
        assert status == 200
    await settled(gw, [r])
    await sub.wait(lambda: held(gw, r.url) == truth(r) != set())


async def test_offloaded_blocks_and_other_kv_cache_groups_are_kept_apart():
    """A CPU offload tier publishes its own stores and removals, a hybrid model's other KV
    cache groups theirs: only GPU blocks of group 0 count as held (the tier's are kept apart,
    tests/test_kv_events_tiers.py), and a removal elsewhere does not uncount them."""
    fake = FakePublisher()
    index = MemoryIndex()
    url = "http://replica"
    sub = KVEventSubscriber(
        index,
        lambda urls: {u: Endpoints(fake.endpoint) for u in urls},
        lambda: [url],
        lambda url: BS,
    )
    await sub.start()
    try:
        await fake.subscribed()
        stream = sub.streams[url]
        tokens = list(range(3 * BS))
        gpu = set(continue_chain(root_hash(), tokens, BS))
        frames = [
            batch(stored(tokens, None, [1, 2, 3])),
            batch(stored(tokens, None, [1, 2, 3], medium="CPU")),  # offloaded copies
            batch(stored(tokens[:BS], None, [1], group_idx=1)),  # another group
            batch(
                {"type": "BlockRemoved", "block_hashes": [2, 3], "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
            ),
        ]
        for seq, payload in enumerate(frames):
            await fake.send(b"", seq.to_bytes(8, "big"), payload)
        await sub.wait(lambda: stream.last_applied == len(frames) - 1)
        assert index.blocks(url) == gpu and stream.other_tier_blocks == 1
        assert stream.tiers.sizes() == {"CPU": 1}
        await fake.send(
            b"",
            len(frames).to_bytes(8, "big"),
            batch({"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}),
        )
        await sub.wait(lambda: stream.last_applied == len(frames))
        assert index.blocks(url) == gpu - {continue_chain(root_hash(), tokens, BS)[2]}
        assert stream.errors == {}
    finally:
        await sub.stop()
        fake.close()
