"""Precise mode over real ZMQ sockets: simulated replicas publish vLLM's KV events, the
gateway's index follows them exactly.

The truth is the simulator's block pool: every hash some block holds, turned into the
gateway's hash by walking the pool's own record of each block's parent, tokens, LoRA and salt
(``BlockPool.lineage``) with ``router.core.blocks``. The events, the wire and the subscriber play no
part in computing it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from router.core.blocks import continue_chain, root_hash
from router.index import MemoryIndex
from router.index.redis import make_client
from router.kv_events import Endpoints, KVEventSubscriber
from router.kv_events.wire import BlockStored, Skipped, WireError, decode_batch, parse_frames
from tests.helpers import post, wait_for

BS = 16
MODEL = "Qwen/Qwen3-0.6B"
KV = {
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
    "instant": True,
    "lora_adapters": ["ad1"],
}


def truth(replica: Any) -> set[int]:
    """The gateway hashes of every block the simulated replica's cache holds now (keyed, as
    the gateway keys them, by the replica's model: router/models/)."""
    pool = replica.engine.pool
    model = replica.config.model
    memo: dict[bytes, int] = {}

    def gateway_hash(h: bytes) -> int:
        if h not in memo:
            parent, tokens, lora, salt = pool.lineage[h]
            p = root_hash(salt, lora, model) if parent is None else gateway_hash(parent)
            memo[h] = continue_chain(p, tokens, BS)[0]
        return memo[h]

    return {gateway_hash(h) for h in pool.cached_hashes()}


def endpoints(replicas: list[Any]) -> dict[str, Any]:
    return {
        r.url: {"endpoint": r.kv_events.endpoint, "replay_endpoint": r.kv_events.replay_endpoint}
        for r in replicas
    }


def body(i: int, *, system: int | None = None, salt: str | None = None, lora: bool = False):
    b: dict[str, Any] = {
        "model": "ad1" if lora else MODEL,
        "max_tokens": 20,  # generated blocks are cached (and published) too
        "messages": [
            {
                "role": "system",
                "content": f"System prompt number {system if system is not None else i}. " * 40,
            },
            {"role": "user", "content": f"question {i}"},
        ],
    }
    if salt:
        b["cache_salt"] = salt
    return b


def mixed(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [
        body(
            i,
            system=i % 5,
            salt=f"tenant-{i % 2}" if i % 3 == 0 else None,
            lora=i % 4 == 0,
        )
        for i in range(offset, offset + n)
    ]


async def send(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]) -> None:
    for chunk in range(0, len(bodies), 4):  # a little concurrency: duplicate holders happen
        results = await asyncio.gather(
            *(post(session, url + "/v1/chat/completions", b) for b in bodies[chunk : chunk + 4])
        )
        assert [s for s, _, _ in results] == [200] * len(results), results


async def settled(gw: Any, replicas: list[Any]) -> None:
    """Every replica idle and every batch it published applied by the gateway."""
    sub = gw.gateway.kv_events
    for r in replicas:
        await r.wait_idle()
        assert await sub.catch_up(r.url)  # the tail too, whatever the live socket dropped
        await sub.wait(lambda r=r: sub.streams[r.url].last_applied == r.kv_events.next_seq - 1)


def held(gw: Any, url: str) -> set[int]:
    index = gw.gateway.index.inner
    assert isinstance(index, MemoryIndex)
    return index.blocks(url)


async def start(fleet, gateway, n: int = 2, **sim: Any):
    replicas = await fleet(n, **{**KV, **sim})
    gw = await gateway(
        [r.url for r in replicas], kv_events=True, kv_events_endpoints=endpoints(replicas)
    )
    sub = gw.gateway.kv_events
    await sub.wait(lambda: all(s.connected and s.up for s in sub.streams.values()))
    return replicas, gw, sub


async def test_index_equals_the_replicas_caches_after_evictions_and_a_reset(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, num_gpu_blocks=120)
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(40))
        await settled(gw, replicas)
        assert all(r.engine.pool.evictions > 0 for r in replicas)  # the pools overflowed
        for r in replicas:
            assert held(gw, r.url) == truth(r)
        # A cache reset on one replica (all blocks free: vLLM's AllBlocksCleared) ...
        reset = replicas[0]
        async with session.post(reset.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        await settled(gw, replicas)
        assert truth(reset) == set() and held(gw, reset.url) == set()
        assert sub.streams[reset.url].resets == 1
        # ... and more traffic afterwards.
        await send(session, gw.url, mixed(30, offset=100))
        await settled(gw, replicas)
    for r in replicas:
        assert held(gw, r.url) == truth(r)
        assert sub.streams[r.url].errors == {}
    # Salted and LoRA blocks were among them, and stayed apart from the plain ones.
    lineage = [v for r in replicas for v in r.engine.pool.lineage.values()]
    assert any(salt for _, _, _, salt in lineage) and any(lora for _, _, lora, _ in lineage)


async def test_a_gap_is_caught_up_from_the_replay_socket(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, n=1, num_gpu_blocks=100)
    (r,) = replicas
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(4))
        await settled(gw, replicas)
        replays = sub.streams[r.url].replays
        r.kv_events.skip_next(3)  # numbered and buffered, never sent on the PUB socket
        for b in mixed(6, offset=10):
            await send(session, gw.url, [b])
        await settled(gw, replicas)
    stream = sub.streams[r.url]
    assert r.engine.pool.evictions > 0
    assert stream.replays > replays and stream.resets == 0
    assert held(gw, r.url) == truth(r)


async def test_a_gap_beyond_the_replay_buffer_resets_the_replica(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, n=1, num_gpu_blocks=400)
    (r,) = replicas
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(2))
        # A full replay buffer while the subscription settles (a first live message can be
        # lost to ZMQ's slow joiner, and vLLM's 10,000 steps would bring it back) ...
        await settled(gw, replicas)
        before = held(gw, r.url)
        assert before == truth(r)
        # ... then one step, so the hole below is beyond what the replay holds.
        r.kv_events.keep_steps(1)
        r.kv_events.skip_next(3)
        for b in mixed(5, offset=20):
            await send(session, gw.url, [b])
        await settled(gw, replicas)
    stream = sub.streams[r.url]
    assert stream.resets == 1
    # What was learned before the hole is gone; what followed it is exact.
    assert not (before & held(gw, r.url)) or held(gw, r.url) <= truth(r)
    assert held(gw, r.url) <= truth(r)


async def test_a_dead_publisher_falls_back_to_the_approximate_model(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, n=1, num_gpu_blocks=400)
    (r,) = replicas
    await r.stop_kv_events()
    await sub.wait(lambda: not sub.streams[r.url].up)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert f'prefix_router_kv_events_up{{replica="{r.url}"}} 0.0' in text
        status, _, explained = await post(session, gw.url + "/v1/route/explain", body(1))
        assert status == 200
        assert [c["kv_events"]["up"] for c in explained["candidates"]] == [False]
        # Routing goes on, on placements: the second request is predicted to hit.
        b = body(1)
        s1, _, _ = await post(session, gw.url + "/v1/chat/completions", b)
        s2, headers, _ = await post(session, gw.url + "/v1/chat/completions", b)
    assert (s1, s2) == (200, 200)
    assert int(headers["x-prefix-router-cached-blocks"]) > 0


async def test_a_lost_last_message_is_caught_up_by_the_replay_probe(fleet, gateway):
    replicas = await fleet(1, **{**KV, "num_gpu_blocks": 400})
    (r,) = replicas
    gw = await gateway(
        [r.url], kv_events=True, kv_events_endpoints=endpoints(replicas), kv_events_timeout_s=0.3
    )
    sub = gw.gateway.kv_events
    await sub.wait(lambda: sub.streams[r.url].up)
    r.kv_events.mute = True  # connected, numbering, buffering, sending nothing live
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, [body(1), body(2)])
    await r.wait_idle()
    # No later message shows a gap: the silence after the placements makes the gateway ask.
    await sub.wait(lambda: sub.streams[r.url].last_applied == r.kv_events.next_seq - 1)
    assert sub.streams[r.url].up
    assert held(gw, r.url) == truth(r)


async def test_a_silent_publisher_without_replay_is_marked_down_and_comes_back(fleet, gateway):
    replicas = await fleet(1, **{**KV, "num_gpu_blocks": 400, "kv_events_replay_endpoint": None})
    (r,) = replicas
    gw = await gateway(
        [r.url], kv_events=True, kv_events_endpoints=endpoints(replicas), kv_events_timeout_s=0.3
    )
    sub = gw.gateway.kv_events
    stream = sub.streams[r.url]
    await sub.wait(lambda: stream.up)
    async with aiohttp.ClientSession() as session:
        # Connected is not yet subscribed (ZMQ's slow joiner), and nothing replays here:
        # publish until a message gets through.
        for i in range(50):
            await send(session, gw.url, [body(100 + i)])
            await r.wait_idle()
            if stream.last_applied is not None:
                break
        await sub.wait(lambda: stream.last_applied == r.kv_events.next_seq - 1)
        r.kv_events.mute = True
        await send(session, gw.url, [body(1)])
        await sub.wait(lambda: not stream.up)
        r.kv_events.mute = False
        await send(session, gw.url, [body(2)])  # a gap nobody can replay: reset, then exact
        await r.wait_idle()
        await sub.wait(lambda: stream.up and stream.last_applied == r.kv_events.next_seq - 1)
    assert stream.resets == 1
    assert held(gw, r.url) <= truth(r)


async def test_a_restarted_replica_starts_its_stream_over(fleet, gateway):
    replicas, gw, sub = await start(fleet, gateway, n=1, num_gpu_blocks=400)
    (r,) = replicas
    stream = sub.streams[r.url]
    async with aiohttp.ClientSession() as session:
        await send(session, gw.url, mixed(6))
        await settled(gw, replicas)
        before = held(gw, r.url)
        await r.stop()
        await sub.wait(lambda: not stream.connected)
        await r.start(port=r.port)  # a new process: empty cache, seq from 0, same ports
        await sub.wait(lambda: stream.connected)
        await send(session, gw.url, mixed(2, offset=50))
        await settled(gw, replicas)
    assert stream.resets >= 1 or stream.last_applied == r.kv_events.next_seq - 1
    now = held(gw, r.url)
    assert now <= truth(r) and not (before - truth(r)) & now  # nothing of the old cache left


# -- hostile streams ------------------------------------------------------------------


class FakePublisher:
    """A PUB socket the test writes arbitrary frames to, and a replay socket that answers
    nothing."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB: we see the subscription arrive
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    async def subscribed(self) -> None:
        while (await self.pub.recv())[:1] != b"\x01":  # not an unsubscription
            pass

    async def send(self, *frames: bytes) -> None:
        await self.pub.send_multipart(frames)

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


def stored(seq_tokens: list[int], parent: int | None, hashes: list[int], **extra: Any) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": seq_tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def batch(*events: Any) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


async def test_hostile_frames_never_crash_or_corrupt_the_index():
    fake = FakePublisher()
    index = MemoryIndex()
    url = "http://replica"
    sub = KVEventSubscriber(
        index,
        lambda urls: {u: Endpoints(fake.endpoint) for u in urls},
        lambda: [url],
        lambda url: BS,
        max_message_bytes=64 * 1024,
        timeout_s=1.0,
        reconnect_s=0.2,
    )
    await sub.start()
    try:
        await fake.subscribed()
        stream = sub.streams[url]
        tokens = list(range(2 * BS))
        good = [101, 102]
        seq = 0

        async def frames(*f: bytes) -> None:
            await fake.send(*f)

        def s8(n: int) -> bytes:
            return n.to_bytes(8, "big")

        await frames(b"only one frame")
        await frames(b"", b"short seq", b"x")
        await frames(b"", s8(seq), b"\xc1 not msgpack")
        seq += 1
        await frames(b"", s8(seq), msgpack.packb({"not": "a batch"}))
        seq += 1
        await frames(
            b"",
            s8(seq),
            batch(
                {"type": "BlockSwapped", "block_hashes": [1]},
                stored(tokens[:5], None, [7]),  # tokens are not one block per hash
                stored(tokens, None, [-5, 3]),  # a hash no uint64 holds
                stored([-1] * BS, None, [9]),
                {"type": "BlockRemoved", "block_hashes": "nope"},
                ["BlockRemoved"],
                "just a string",
            ),
        )
        seq += 1
        await frames(b"", s8(seq), b"\x00" * (128 * 1024))  # beyond MAXMSGSIZE: peer dropped
        await sub.wait(lambda: stream.errors.get("unknown_type", 0) >= 1)
        assert index.blocks(url) == set()
        # The stream still works: once ZMQ reconnected, a valid store lands, exactly.
        await sub.wait(lambda: stream.disconnects == 1)
        await fake.subscribed()
        seq += 5
        await frames(b"", s8(seq), batch(stored(tokens, None, good)))
        await sub.wait(lambda: stream.last_applied == seq)
        assert index.blocks(url) == set(continue_chain(root_hash(), tokens, BS))
        assert stream.errors["frames"] == 2 and stream.errors["msgpack"] == 1
        assert stream.errors["batch"] == 1 and stream.errors["malformed"] >= 5
        # Removing an unknown hash, or one twice, changes nothing else.
        seq += 1
        await frames(b"", s8(seq), batch({"type": "BlockRemoved", "block_hashes": [999, 102, 102]}))
        await sub.wait(lambda: stream.last_applied == seq)
        assert index.blocks(url) == set(continue_chain(root_hash(), tokens, BS)[:1])
    finally:
        await sub.stop()
        fake.close()


def test_wire_decoding_rejects_what_it_cannot_read():
    with pytest.raises(WireError):
        parse_frames([b"a"])
    assert parse_frames([b"topic", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")
    assert parse_frames([(-1).to_bytes(8, "big", signed=True), b""]) == (-1, b"")
    with pytest.raises(WireError):
        decode_batch(b"\x93")  # truncated
    with pytest.raises(WireError):
        decode_batch(msgpack.packb([1.0] * 3))
    # Old vLLM's array-shaped events, and the salt read back from block 0's extra keys.
    tokens = list(range(BS))
    (old,) = decode_batch(batch(["BlockStored", [5], None, tokens, BS, None, "GPU"]))
    assert isinstance(old, BlockStored) and old.block_hashes == [5]
    (salted,) = decode_batch(
        batch(stored(tokens, None, [5], lora_name="ad1", extra_keys=[["ad1", "s3cret"]]))
    )
    assert isinstance(salted, BlockStored)
    assert salted.cache_salt() == "s3cret" and salted.lora_name == "ad1"
    (unknown,) = decode_batch(batch({"type": "Future"}))
    assert unknown == Skipped("unknown_type", "Future")


# vLLM 0.34's own encoder (msgspec, vllm/distributed/kv_events.py structs) on these events:
# two stores (one LoRA + salted from block 0, one chained), a removal, a clear.
VLLM_BYTES = bytes.fromhex(
    "93cb41d954fc4010000094de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a3616431aa65787472615f6b6579739292a3616431a473616c7491a3616431a967726f75705f69647800de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_the_simulator_writes_vllms_bytes():
    from loadtest.sim.kv_events import encode_batch
    from loadtest.sim.kvcache import BlockPool, block_hashes

    events = [
        {
            "type": "BlockStored",
            "block_hashes": [2**64 - 1, 7],
            "parent_block_hash": None,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_id": 1,
            "medium": "GPU",
            "lora_name": "ad1",
            "extra_keys": [("ad1", "salt"), ("ad1",)],
            "group_idx": 0,
        },
        {
            "type": "BlockStored",
            "block_hashes": [9],
            "parent_block_hash": 7,
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    assert encode_batch(events, 1700000000.25, 0) == VLLM_BYTES
    # The block pool builds its events in that shape.
    pool = BlockPool(2, events=True)
    tokens = list(range(8))
    hashes = block_hashes(tokens, 4, lora="ad1", cache_salt="salt")
    for b, h in zip(pool.allocate(2), hashes, strict=True):
        pool.cache(b, h)
    pool.stored(hashes, None, tokens, 4, first_block=0, lora="ad1", lora_id=1, cache_salt="salt")
    (ev,) = pool.take_events()
    assert list(ev) == list(events[0])
    assert ev["extra_keys"] == events[0]["extra_keys"] and ev["lora_id"] == 1
    assert ev["block_hashes"] == [int.from_bytes(h[-8:], "big") for h in hashes]


def test_endpoints_are_listed_or_derived_from_the_replica_host():
    from router.kv_events import endpoints_from_config

    eps = endpoints_from_config(
        ["http://10.0.0.1:8000", "http://[::1]:8000", "http://listed:8000"],
        {"http://listed:8000": {"endpoint": "tcp://ev:1", "replay_endpoint": "tcp://ev:2"}},
        5557,
        5558,
    )
    assert eps["http://10.0.0.1:8000"] == Endpoints("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert eps["http://[::1]:8000"].pub == "tcp://[::1]:5557"
    assert eps["http://listed:8000"] == Endpoints("tcp://ev:1", "tcp://ev:2")


# -- fleet mode: one gateway writes each stream -----------------------------------------


async def fleet_gateways(fleet, gateway, redis_server, n_gw: int = 3, n: int = 2, **sim: Any):
    replicas = await fleet(n, **{**KV, **sim})
    gws = [
        await gateway(
            [r.url for r in replicas],
            kv_events=True,
            kv_events_endpoints=endpoints(replicas),
            redis_url=redis_server.url,
            redis_prefix="kvfleet",
            sync_interval_s=0.1,
            redis_timeout_ms=250.0,
        )
        for _ in range(n_gw)
    ]
    return replicas, gws


def owners(gws: list[Any], url: str) -> list[Any]:
    return [g for g in gws if g.gateway.kv_events.streams[url].owned]


async def one_owner_each(gws: list[Any], replicas: list[Any]) -> None:
    async def settled() -> bool:
        return all(len(owners(gws, r.url)) == 1 for r in replicas)

    await wait_for(settled, timeout=15.0, what="one owner per stream")


async def fleet_settled(gws: list[Any], replicas: list[Any]) -> None:
    """Every replica idle, and every gateway applied (and, the owner, wrote) every batch."""
    for r in replicas:
        await r.wait_idle()
        last = r.kv_events.next_seq - 1
        for g in gws:
            sub = g.gateway.kv_events
            assert await sub.catch_up(r.url)
            stream = sub.streams[r.url]
            await sub.wait(
                lambda s=stream, n=last: s.written.startswith(f"{n}:") and not s.applying
            )
    for g in gws:  # placements are written off the request path in fleet mode
        while g.gateway._background:
            await asyncio.gather(*list(g.gateway._background), return_exceptions=True)
        shared = getattr(g.gateway.index, "inner", None)
        if shared is not None and hasattr(shared, "flush") and shared.redis_up:
            assert await shared.flush()  # the index writes queued for Redis, sent


async def shared_settled(client: Any, gws: list[Any], replicas: list[Any]) -> None:
    """Each stream has one owner, up on Redis, whose last applied batch is the stamp in Redis
    (a stamp is written only by an owner that missed no shared write since its takeover)."""
    leases = gws[0].gateway.kv_events.leases

    async def ok() -> bool:
        for r in replicas:
            found = owners(gws, r.url)
            if len(found) != 1 or not found[0].gateway.index.inner.redis_up:
                return False
            stamp = await client.get(leases.stamp_key(r.url))
            if stamp is None or stamp.decode() != found[0].gateway.kv_events.streams[r.url].written:
                return False
        return True

    await wait_for(ok, timeout=15.0, what="every stream's writes stamped in Redis")


async def shared(client: Any, gw: Any, url: str) -> set[int]:
    """The replica's blocks in Redis, as every gateway reads them."""
    primary = gw.gateway.index.inner.primary
    raw = await client.zrange(primary.blocks_key(url), 0, -1)
    return {int.from_bytes(m, "little") for m in raw}


async def test_fleet_mode_one_gateway_writes_each_stream_and_hands_over(
    fleet, gateway, redis_server
):
    replicas, gws = await fleet_gateways(fleet, gateway, redis_server, num_gpu_blocks=150)
    await one_owner_each(gws, replicas)
    client = make_client(redis_server.url, socket_timeout=2.0, connect_timeout=1.0)
    try:
        await handover(client, gws, replicas)
    finally:
        await client.aclose()


async def handover(client: Any, gws: list[Any], replicas: list[Any]) -> None:
    leases = gws[0].gateway.kv_events.leases
    before = {
        (id(g), r.url): g.gateway.kv_events.streams[r.url].shared_batches
        for g in gws
        for r in replicas
    }

    async def send_round_robin(bodies: list[dict[str, Any]], via: list[Any]) -> None:
        async with aiohttp.ClientSession() as session:
            for i in range(0, len(bodies), 4):
                await send(session, via[(i // 4) % len(via)].url, bodies[i : i + 4])

    await send_round_robin(mixed(40), gws)
    # The test follows eviction events on every replica. How 40 prompts spread depends on the
    # load the gateways see, so fresh prompts are added until every replica has evicted.
    for offset in range(100, 200, 16):  # below the gap phase's prompts (offset 200)
        if all(r.engine.pool.evictions > 0 for r in replicas):
            break
        await send_round_robin(mixed(16, offset=offset), gws)
    await fleet_settled(gws, replicas)
    await shared_settled(client, gws, replicas)
    assert all(r.engine.pool.evictions > 0 for r in replicas)
    for r in replicas:
        (owner,) = owners(gws, r.url)
        assert (await client.get(leases.lease_key(r.url))).decode() == (
            owner.gateway.sync.gateway_id
        )
        # Exactly one gateway wrote the stream's events to Redis; all followed it locally.
        written = [
            g.gateway.kv_events.streams[r.url].shared_batches - before[id(g), r.url] for g in gws
        ]
        assert sorted(w > 0 for w in written) == [False, False, True], written
        assert await shared(client, gws[0], r.url) == truth(r)
        for g in gws:
            assert g.gateway.index.inner.local.blocks(r.url) >= truth(r)

    # The owner of replica 0 crashes: no release, no more renewals; its lease expires and
    # another gateway takes the stream over.
    r0 = replicas[0]
    (dead,) = owners(gws, r0.url)
    dead_id = dead.gateway.sync.gateway_id
    await dead.gateway.kv_events.stop(release=False)
    alive = [g for g in gws if g is not dead]
    await one_owner_each(alive, replicas)
    (heir,) = owners(alive, r0.url)
    assert heir.gateway.kv_events.streams[r0.url].takeovers == 1

    # A gap: the lease held by a zombie (the test renews it for the dead gateway) while
    # traffic flows, so nobody writes replica 0's events; then it expires and whoever claims
    # it catches up from the stamped seq, out of its log of the writes it skipped.
    await client.set(leases.lease_key(r0.url), dead_id, px=60_000)

    async def disowned() -> bool:
        return not owners(alive, r0.url)

    await wait_for(disowned, what="the zombie's lease seen")
    await send_round_robin(mixed(16, offset=200), alive)
    await fleet_settled(alive, replicas)
    assert await shared(client, alive[0], r0.url) != truth(r0)  # nobody wrote the gap
    caught_up = sum(g.gateway.kv_events.streams[r0.url].caught_up for g in alive)
    await client.delete(leases.lease_key(r0.url))
    await shared_settled(client, alive, replicas)
    assert sum(g.gateway.kv_events.streams[r0.url].caught_up for g in alive) > caught_up
    for r in replicas:
        assert await shared(client, alive[0], r.url) == truth(r)

    # A stamp the new owner cannot find in its log (another publisher process, a lost key):
    # it rewrites the replica's shared entry from its exact holder set instead.
    resyncs = {id(g): g.gateway.kv_events.streams[r0.url].resyncs for g in alive}
    (owner,) = owners(alive, r0.url)
    await owner.gateway.kv_events.stop(release=False)
    await client.set(leases.stamp_key(r0.url), "999999:0")
    rest = [g for g in alive if g is not owner]
    await shared_settled(client, rest, replicas)
    (last,) = owners(rest, r0.url)
    assert last.gateway.kv_events.streams[r0.url].resyncs == resyncs[id(last)] + 1
    assert await shared(client, last, r0.url) == truth(r0)


async def test_fleet_mode_redis_restart_rebuilds_the_shared_index_from_the_events(
    fleet, gateway, redis_server
):
    """Redis dies mid-traffic: requests go on (each gateway routes on its exact local view),
    nobody claims a stream while Redis is away; once it is back (empty), each stream's new
    owner finds no stamp and rewrites the replica's shared entry from its holder set."""
    replicas, gws = await fleet_gateways(fleet, gateway, redis_server, n_gw=2, num_gpu_blocks=150)
    await one_owner_each(gws, replicas)
    client = make_client(redis_server.url, socket_timeout=2.0, connect_timeout=1.0)
    try:
        async with aiohttp.ClientSession() as session:
            await send(session, gws[0].url, mixed(12))
            redis_server.kill()

            async def all_down() -> bool:
                return all(not g.gateway.index.inner.redis_up for g in gws) and not any(
                    owners(gws, r.url) for r in replicas
                )

            await send(session, gws[1].url, mixed(12, offset=50))  # trips the circuits
            await wait_for(all_down, what="every gateway on its local view, no owner")
            await send(session, gws[0].url, mixed(12, offset=100))
            await fleet_settled(gws, replicas)
            for g in gws:  # the local views followed the events all along
                for r in replicas:
                    assert g.gateway.index.inner.local.blocks(r.url) >= truth(r)
            resyncs = sum(g.gateway.kv_events.streams[r.url].resyncs for g in gws for r in replicas)
            redis_server.start()  # same port, no data
            await shared_settled(client, gws, replicas)
        assert sum(
            g.gateway.kv_events.streams[r.url].resyncs for g in gws for r in replicas
        ) >= resyncs + len(replicas)
        for r in replicas:
            assert await shared(client, gws[0], r.url) == truth(r)
    finally:
        await client.aclose()
