"""RedisMapIndex (one hash per model, batched writes) against a real redis-server."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from router.index.memory import MemoryIndex
from router.index.redis import make_client
from router.index.redis_map import RedisMapIndex
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401  (fixture)
from tests.test_redis_index import MODEL, REPLICAS, Universe

pytestmark = pytest.mark.usefixtures("redis_server")


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    c = make_client(redis_server.url)
    yield c
    await c.aclose()


async def commandstats(client: Redis) -> dict[str, int]:
    """Calls per command so far (Redis's own count; commands run inside scripts included)."""
    stats = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


async def random_ops(
    client: Redis, seed: int, *, capacity: int, flush_every: float, refresh: int | None
) -> None:
    """Random records, matches, forgets, capacity changes and drops on the map index and on a
    MemoryIndex, flushing after a write with probability ``flush_every``: every match and
    every flushed size must equal the in-memory index's."""
    rng = random.Random(seed)
    uni = Universe(rng)
    mem = MemoryIndex(default_capacity=capacity)
    red = RedisMapIndex(client, MODEL, default_capacity=capacity, refresh_blocks=refresh)
    for step in range(400):
        op = rng.random()
        replica = rng.choice(REPLICAS)
        if op < 0.4:
            p = uni.prompt() if rng.random() < 0.5 or not uni.prompts else rng.choice(uni.prompts)
            blocks = p[: rng.randint(1, len(p))]
            await mem.record(replica, blocks)
            await red.record(replica, blocks)
        elif op < 0.75:
            p = rng.choice(uni.prompts) if uni.prompts else uni.prompt()
            query = p + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
            cands = rng.sample(REPLICAS, rng.randint(1, len(REPLICAS)))
            assert await red.match(query, cands) == await mem.match(query, cands), step
            continue
        elif op < 0.87 and uni.prompts:
            gone = uni.subtree(rng.choice(rng.choice(uni.prompts)))
            await mem.forget(replica, gone)
            await red.forget(replica, gone)
        elif op < 0.97:
            cap = rng.randint(3, 150) if capacity < 1000 else capacity
            await mem.set_capacity(replica, cap)
            await red.set_capacity(replica, cap)
        else:
            await mem.drop_replica(replica)
            await red.drop_replica(replica)
        if rng.random() < flush_every:
            await red.flush()
            for r in REPLICAS:
                if red.size(r) or mem.size(r):
                    assert red.size(r) == mem.size(r), (step, r)
    await red.flush()
    for p in uni.prompts:
        assert await red.match(p, REPLICAS) == await mem.match(p, REPLICAS)


@pytest.mark.parametrize("seed", range(4))
async def test_flushed_after_each_write_it_is_the_memory_index_under_trimming(
    client: Redis, seed: int
) -> None:
    """Exact LRU (every block rewritten), trimmed at every flush: as MemoryIndex."""
    await random_ops(client, seed, capacity=120, flush_every=1.0, refresh=None)


@pytest.mark.parametrize("seed", range(4))
async def test_queued_writes_are_seen_by_this_gateways_matches(client: Redis, seed: int) -> None:
    """Flushes now and then (records, forgets and drops queued in between): while it fits, the
    matches still equal MemoryIndex's, bounded records included."""
    await random_ops(client, seed, capacity=10_000, flush_every=0.1, refresh=4)


async def test_a_match_is_one_command_and_a_batch_a_few(client: Redis) -> None:
    idx = RedisMapIndex(client, MODEL, default_capacity=50, refresh_blocks=64)
    rng = random.Random(0)
    heads = [[rng.getrandbits(64) for _ in range(30)] for _ in range(5)]
    await idx.record(REPLICAS[0], heads[0])
    await idx.flush()
    await idx.match(heads[0], REPLICAS[:2])  # the match script loaded
    before = await commandstats(client)
    for i in range(100):
        prompt = heads[i % 5] + [rng.getrandbits(64) for _ in range(3)]
        await idx.match(prompt, REPLICAS[:2])
        await idx.record(REPLICAS[i % 2], prompt)
    await idx.flush()
    after = await commandstats(client)
    spent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    spent.pop("info", None)
    assert spent.pop("hmget") == 100 + 1  # the matches', and the batch's one read
    assert spent.pop("evalsha") == 100 + 1  # each match one script call, the batch one
    # one HSET and one HDEL (blocks no replica holds any more), per replica one ZADD and one
    # ZPOPMIN (over capacity); the first flush of a replica's keys also counts them and gives
    # them their TTLs
    assert spent == {"hset": 1, "hdel": 1, "zadd": 2, "zpopmin": 2, "zcard": 2, "pexpire": 3}
    assert idx.size(REPLICAS[0]) == idx.size(REPLICAS[1]) == 50
    assert await client.zcard(idx.blocks_key(REPLICAS[1])) == 50
    # the trimmed blocks left the map too: every block there is in a zset
    held = await client.hgetall(idx.map_key(REPLICAS[0]))
    blocks = {f for f in held if len(f) == 8}
    zsets = set()
    for r in REPLICAS[:2]:
        zsets |= set(await client.zrange(idx.blocks_key(r), 0, -1))
    assert blocks == zsets


async def test_two_gateways_see_each_other_after_a_flush(client: Redis) -> None:
    a = RedisMapIndex(client, MODEL)
    b = RedisMapIndex(client, MODEL)
    await a.record(REPLICAS[0], [1, 2, 3])
    assert await a.match([1, 2, 3, 4], REPLICAS[:1]) == {REPLICAS[0]: 3}  # its own queue
    assert await b.match([1, 2, 3, 4], REPLICAS[:1]) == {REPLICAS[0]: 0}  # not flushed yet
    await a.flush()
    assert await b.match([1, 2, 3, 4], REPLICAS[:2]) == {REPLICAS[0]: 3, REPLICAS[1]: 0}
    await b.record(REPLICAS[1], [1, 2])
    await b.forget(REPLICAS[0], [3])
    await b.flush()
    assert await a.match([1, 2, 3], REPLICAS[:2]) == {REPLICAS[0]: 2, REPLICAS[1]: 2}
    await a.drop_replica(REPLICAS[0])
    assert await b.match([1, 2, 3], REPLICAS[:2]) == {REPLICAS[0]: 0, REPLICAS[1]: 2}
    assert await client.exists(a.blocks_key(REPLICAS[0])) == 0


@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", "a{b}c", "org/m%7B"])
async def test_a_models_keys_share_one_cluster_slot(client: Redis, model: str) -> None:
    idx = RedisMapIndex(client, model, namespace="pr")
    await idx.record(REPLICAS[0], [1, 2])
    await idx.record(REPLICAS[1], [1])
    await idx.flush()
    keys = [k.decode() for k in await client.keys("pr:*")]
    assert len(keys) == 3 and len({key_slot(k.encode()) for k in keys}) == 1, keys
    assert all([await client.pttl(k) > 0 for k in keys])
