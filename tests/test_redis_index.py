"""RedisIndex and ResilientIndex against a real redis-server."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.asyncio import Connection, Redis
from redis.crc import key_slot

from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex, key_prefix, make_client, model_tag
from router.index.resilient import ResilientIndex
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401  (fixture)

MODEL = "Qwen/Qwen3-8B"
REPLICAS = ["http://r0:8000", "http://r1:8000", "http://r2:8000", "http://r3:8000"]


class CountingConnection(Connection):
    """Counts writes to the socket: one per command, one per pipeline (= round trips)."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        await super().send_packed_command(command, check_health)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    c = make_client(redis_server.url)
    yield c
    await c.aclose()


class Universe:
    """Prompts as paths in a tree of blocks (each block's hash determines its parent, as with
    chained hashes), so that forgetting a block can forget its whole subtree and the chain
    assumption holds by construction."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.children: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = []

    def _new(self, parent: int | None) -> int:
        h = self.rng.getrandbits(64)
        if parent is not None:
            self.children.setdefault(parent, []).append(h)
        return h

    def prompt(self, max_len: int = 40) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.7:  # extend a prefix of an earlier prompt
            base = rng.choice(self.prompts)
            path = base[: rng.randint(1, len(base))]
        else:
            path = [self._new(None)]
        while len(path) < rng.randint(1, max_len):
            path.append(self._new(path[-1]))
        self.prompts.append(path)
        return path

    def subtree(self, h: int) -> list[int]:
        out, stack = [], [h]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(self.children.get(x, ()))
        self.rng.shuffle(out)
        return out


# -- RedisIndex -------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["binary", "decimal"])
@pytest.mark.parametrize("seed", range(6))
async def test_matches_memory_index_on_random_operations(
    client: Redis, encoding: str, seed: int
) -> None:
    rng = random.Random(seed)
    uni = Universe(rng)
    mem = MemoryIndex(default_capacity=120)
    red = RedisIndex(client, MODEL, default_capacity=120, encoding=encoding)  # type: ignore[arg-type]
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
            want = await mem.match(query, cands)
            got = await red.match(query, cands)
            assert got == want, f"step {step}"
        elif op < 0.87 and uni.prompts:
            p = rng.choice(uni.prompts)
            gone = uni.subtree(rng.choice(p))
            await mem.forget(replica, gone)
            await red.forget(replica, gone)
        elif op < 0.97:
            cap = rng.randint(3, 150)
            await mem.set_capacity(replica, cap)
            await red.set_capacity(replica, cap)
        else:
            await mem.drop_replica(replica)
            await red.drop_replica(replica)
        for r in REPLICAS:
            assert red.size(r) == mem.size(r), f"step {step}, {r}"
    for p in uni.prompts:
        assert await red.match(p, REPLICAS) == await mem.match(p, REPLICAS)


async def test_empty_inputs_need_no_round_trip(client: Redis) -> None:
    idx = RedisIndex(client, MODEL)
    assert await idx.match([], REPLICAS) == dict.fromkeys(REPLICAS, 0)
    assert await idx.match([1, 2], []) == {}
    await idx.record(REPLICAS[0], [])
    await idx.forget(REPLICAS[0], [])
    assert await client.dbsize() == 0


async def test_extreme_hash_values_round_trip(client: Redis) -> None:
    hashes = [0, 1, 2**63, 2**64 - 1, 2**32, 2**64 - 2]
    for enc in ("binary", "decimal"):
        idx = RedisIndex(client, f"m-{enc}", encoding=enc)  # type: ignore[arg-type]
        await idx.record("r", hashes)
        assert await idx.match(hashes, ["r"]) == {"r": 6}
        assert await idx.match(hashes[:3] + [12345], ["r"]) == {"r": 3}


async def test_capacity_trim_keeps_the_heads(client: Redis) -> None:
    idx = RedisIndex(client, MODEL)
    prompt = list(range(10_000, 12_500))  # 2500 blocks: several ZADD chunks in the script
    await idx.set_capacity("r", 100)
    await idx.record("r", prompt)
    key = idx.blocks_key("r")
    assert await client.zcard(key) == 100 == idx.size("r")
    assert await idx.match(prompt, ["r"]) == {"r": 100}
    # most recent first: block 0, 1, 2, ...
    top = await idx.client.zrevrange(key, 0, 2)
    assert [int.from_bytes(m, "little") for m in top] == prompt[:3]

    await idx.set_capacity("r", 5000)
    await idx.record("r", prompt)
    assert await client.zcard(key) == 2500
    await idx.set_capacity("r", 40)  # shrinking trims at once
    assert await client.zcard(key) == 40 == idx.size("r")
    assert await idx.match(prompt, ["r"]) == {"r": 40}
    assert await client.get(idx.capacity_key("r")) == b"40"


async def test_capacity_is_shared_between_gateways(client: Redis) -> None:
    a = RedisIndex(client, MODEL, default_capacity=1000)
    b = RedisIndex(client, MODEL, default_capacity=1000)
    await a.set_capacity("r", 10)
    await b.record("r", list(range(1, 51)))  # b never learned the capacity: Redis knows it
    assert await client.zcard(b.blocks_key("r")) == 10
    assert await b.match(list(range(1, 51)), ["r"]) == {"r": 10}

    await client.flushall()  # a Redis restart: capacities gone
    await b.record("r", list(range(1, 51)))  # b only has its default
    assert await client.zcard(b.blocks_key("r")) == 50
    assert await client.exists(b.capacity_key("r")) == 0
    await a.record("r", list(range(1, 51)))  # a knows the capacity and stores it back
    assert await client.get(a.capacity_key("r")) == b"10"
    assert await client.zcard(a.blocks_key("r")) == 10


async def test_keys_have_ttl(client: Redis) -> None:
    idx = RedisIndex(client, MODEL, ttl_s=30)
    await idx.set_capacity("r", 64)
    await idx.record("r", [1, 2, 3])
    for key in (idx.blocks_key("r"), idx.capacity_key("r")):
        assert 0 < await client.pttl(key) <= 30_000


async def test_drop_replica_deletes_its_keys(client: Redis) -> None:
    idx = RedisIndex(client, MODEL)
    await idx.set_capacity("r", 64)
    await idx.record("r", [1, 2, 3])
    await idx.record("s", [1, 2, 3])
    await idx.drop_replica("r")
    assert await client.exists(idx.blocks_key("r"), idx.capacity_key("r")) == 0
    assert idx.size("r") == 0
    assert await idx.match([1, 2, 3], ["r", "s"]) == {"r": 0, "s": 3}


async def test_hole_in_the_middle_is_a_misprediction(client: Redis) -> None:
    """Documents the binary search both indexes use: with block 5 forgotten but 9 still held
    (the chain assumption broken), they report the whole run. The gateway corrects it from the
    reply's cached_tokens by forgetting the tail past the real hit, and then both say 5."""
    prompt = list(range(100, 110))
    mem, red = MemoryIndex(), RedisIndex(client, MODEL)
    for idx in (mem, red):
        await idx.record("r", prompt)
        await idx.forget("r", [prompt[5]])
    assert await red.match(prompt, ["r"]) == await mem.match(prompt, ["r"]) == {"r": 10}
    for idx in (mem, red):  # the reply said 5 blocks were cached
        await idx.forget("r", prompt[5:])
    assert await red.match(prompt, ["r"]) == await mem.match(prompt, ["r"]) == {"r": 5}


async def test_one_round_trip_per_call(redis_server: RedisServer) -> None:
    c = make_client(redis_server.url, connection_class=CountingConnection)
    stats = Redis.from_url(redis_server.url)
    try:
        idx = RedisIndex(c, MODEL)
        rng = random.Random(1)
        prompt = [rng.getrandbits(64) for _ in range(250)]
        # warm up: connection handshake and script loading (NOSCRIPT -> SCRIPT LOAD)
        await idx.record(REPLICAS[0], prompt)
        await idx.forget(REPLICAS[0], prompt[-1:])
        await idx.set_capacity(REPLICAS[0], 65_536)
        await idx.match(prompt, REPLICAS)
        before = await stats.info("commandstats")

        calls: list[tuple[str, Any]] = [
            ("match", idx.match(prompt, REPLICAS)),
            ("record", idx.record(REPLICAS[1], prompt)),
            ("forget", idx.forget(REPLICAS[1], prompt[200:])),
            ("set_capacity", idx.set_capacity(REPLICAS[1], 100)),
            ("match", idx.match(prompt, REPLICAS)),
        ]
        for name, coro in calls:
            n = CountingConnection.sends
            await coro
            assert CountingConnection.sends - n == 1, name
        after = await stats.info("commandstats")
        assert after["cmdstat_evalsha"]["calls"] - before["cmdstat_evalsha"]["calls"] == 5
        assert "cmdstat_eval" not in after
        assert await idx.match(prompt, REPLICAS) == {
            REPLICAS[0]: 249,
            REPLICAS[1]: 100,
            REPLICAS[2]: 0,
            REPLICAS[3]: 0,
        }
    finally:
        await c.aclose()
        await stats.aclose()


@pytest.mark.parametrize("model", [MODEL, "we{ird}model", "}x{", "a%7Bb"])
async def test_keys_share_one_cluster_slot(client: Redis, model: str) -> None:
    idx = RedisIndex(client, model, namespace="pr")
    for r in REPLICAS:
        await idx.set_capacity(r, 10)
        await idx.record(r, [1, 2, 3])
    keys = [k async for k in client.scan_iter(match="*")]
    assert len(keys) == 2 * len(REPLICAS)
    slot = key_slot(f"{{{model_tag(model)}}}".encode())
    assert {key_slot(k) for k in keys} == {slot}
    assert all(k.startswith(key_prefix("pr", model).encode()) for k in keys)


def test_key_names_are_validated() -> None:
    assert key_prefix("prefix-router", "m") == "prefix-router:{m}:"
    assert model_tag("a{b}%") == "a%7Bb%7D%25"
    with pytest.raises(ValueError):
        key_prefix("prefix-router", "")
    with pytest.raises(ValueError):
        key_prefix("x{y}", "m")


# -- ResilientIndex ---------------------------------------------------------------------------


class FakePrimary(MemoryIndex):
    """A primary whose calls can be made slow or failing, and that counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0
        self.fail = False
        self.calls = 0

    async def _gate(self) -> None:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("down")

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        await self._gate()
        return await super().match(block_hashes, replicas)

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        await self._gate()
        await super().record(replica, block_hashes)

    async def ping(self) -> bool:
        await self._gate()
        return True


async def wait_until(cond: Any, timeout: float = 5.0, step: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(step)


async def test_resilient_times_out_then_opens_circuit_and_recovers() -> None:
    primary = FakePrimary()
    res = ResilientIndex(
        primary, match_timeout_s=0.02, probe_interval_s=0.05, min_timeouts=3, min_outage_s=0.0
    )
    states: list[bool] = []
    res.on_state_change(states.append)
    await res.record("r", [1, 2, 3])
    assert await res.match([1, 2, 3], ["r"]) == {"r": 3}
    assert res.fallbacks == 0

    primary.delay = 0.5
    for i in range(3):
        t0 = time.monotonic()
        assert await res.match([1, 2, 3], ["r"]) == {"r": 3}  # answered locally
        assert time.monotonic() - t0 < 0.2
        assert res.redis_up == (i < 2)
    assert res.match_timeouts == 3 and res.fallbacks == 3 and states == [False]

    calls = primary.calls
    t0 = time.monotonic()
    for _ in range(100):  # circuit open: the primary is not even asked
        await res.match([1, 2, 3], ["r"])
    assert time.monotonic() - t0 < 0.1
    await res.record("r", [4])
    assert res.skipped_writes == 1
    assert primary.calls - calls <= 2  # at most the background probes

    primary.delay = 0.0
    await asyncio.wait_for(res.wait_state(True), 5)
    assert states == [False, True]
    before = res.fallbacks
    assert await res.match([1, 2, 3], ["r"]) == {"r": 3}
    assert res.fallbacks == before
    await res.close()


async def test_resilient_one_stall_under_concurrency_keeps_circuit_closed() -> None:
    """A single stall times out every match in flight at once; with traffic that otherwise
    succeeds, that is not an outage."""
    primary = FakePrimary()
    res = ResilientIndex(primary, match_timeout_s=0.01)
    await res.record("r", [1, 2])
    for _ in range(50):
        await res.match([1, 2], ["r"])
    primary.delay = 0.05
    await asyncio.gather(*(res.match([1, 2], ["r"]) for _ in range(16)))
    primary.delay = 0.0
    assert res.match_timeouts == 16 and res.redis_up
    await res.close()


async def test_resilient_burst_after_idle_stalling_at_once_keeps_circuit_closed() -> None:
    primary = FakePrimary()
    res = ResilientIndex(primary, match_timeout_s=0.01)
    primary.delay = 0.03
    await asyncio.gather(*(res.match([1], ["r"]) for _ in range(16)))
    assert res.match_timeouts == 16 and res.redis_up  # all at the same instant: no outage
    primary.delay = 0.0
    await res.close()


async def test_resilient_error_opens_circuit_at_once() -> None:
    primary = FakePrimary()
    res = ResilientIndex(primary, probe_interval_s=0.05)
    primary.fail = True
    assert await res.match([1], ["r"]) == {"r": 0}
    assert not res.redis_up and res.errors == 1
    await res.record("r", [1])  # swallowed (skipped: circuit open)
    primary.fail = False
    await asyncio.wait_for(res.wait_state(True), 5)
    await res.record("r", [1])
    assert await res.match([1], ["r"]) == {"r": 1}
    await res.close()


async def test_resilient_survives_redis_crash_and_restart(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.index.resilient")
    c = make_client(redis_server.url, socket_timeout=0.5, connect_timeout=0.2)
    res = ResilientIndex(
        RedisIndex(c, MODEL, owns_client=True), match_timeout_s=0.05, probe_interval_s=0.05
    )
    down, up = asyncio.Event(), asyncio.Event()
    res.on_state_change(lambda ok: (up if ok else down).set())
    prompt = list(range(1, 251))
    try:
        await res.record(REPLICAS[0], prompt)
        assert await res.match(prompt, REPLICAS) == {
            REPLICAS[0]: 250,
            REPLICAS[1]: 0,
            REPLICAS[2]: 0,
            REPLICAS[3]: 0,
        }
        assert res.fallbacks == 0

        async def traffic(n: int) -> None:
            for _ in range(n):
                got = await res.match(prompt, REPLICAS)
                assert got[REPLICAS[0]] == 250  # from Redis or from the local copy
                await res.record(REPLICAS[0], prompt)
                await asyncio.sleep(0.001)

        runner = asyncio.create_task(traffic(10_000))
        await asyncio.sleep(0.02)
        redis_server.kill()
        await asyncio.wait_for(down.wait(), 5)
        assert not res.redis_up
        # circuit open: no per-request latency
        t0 = time.monotonic()
        for _ in range(200):
            await res.match(prompt, REPLICAS)
        assert (time.monotonic() - t0) / 200 < 0.005
        assert res.fallbacks > 0 and res.errors >= 1

        redis_server.restart()  # same port, empty
        await asyncio.wait_for(up.wait(), 10)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        # Redis is authoritative again and lost everything: only hit rate suffers
        fallbacks = res.fallbacks
        assert (await res.match(prompt, REPLICAS))[REPLICAS[0]] == 0
        assert res.fallbacks == fallbacks
        await res.record(REPLICAS[0], prompt)
        assert (await res.match(prompt, REPLICAS))[REPLICAS[0]] == 250
        assert res.fallbacks == fallbacks
    finally:
        await res.close()
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    recoveries = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(warnings) == 1 and len(recoveries) == 1


async def test_resilient_hung_redis_costs_at_most_the_timeout(redis_server: RedisServer) -> None:
    c = make_client(redis_server.url, socket_timeout=0.5)
    res = ResilientIndex(
        RedisIndex(c, MODEL, owns_client=True),
        match_timeout_s=0.02,
        probe_interval_s=0.05,
        probe_timeout_s=0.05,
    )
    await res.record("r", [1, 2, 3])
    redis_server.pause()
    try:
        worst = 0.0
        for _ in range(20):
            t0 = time.monotonic()
            assert await res.match([1, 2, 3], ["r"]) == {"r": 3}
            worst = max(worst, time.monotonic() - t0)
            if not res.redis_up:
                break
        assert worst < 0.15
        # tripped once >= 5 timeouts spanning >= min_outage_s (0.1 s at 20 ms each)
        assert not res.redis_up and 5 <= res.match_timeouts <= 10
    finally:
        redis_server.resume()
    await asyncio.wait_for(res.wait_state(True), 10)
    assert await res.match([1, 2, 3], ["r"]) == {"r": 3}
    await res.close()


async def test_resilient_replays_drops_missed_while_down(redis_server: RedisServer) -> None:
    c = make_client(redis_server.url)
    res = ResilientIndex(
        RedisIndex(c, MODEL, owns_client=True),
        match_timeout_s=0.02,
        min_timeouts=1,
        min_outage_s=0.0,
        probe_interval_s=0.05,
        probe_timeout_s=0.5,
    )
    await res.record("r", [1, 2, 3])
    redis_server.pause()
    try:
        assert await res.match([1, 2, 3], ["r"]) == {"r": 3}  # timed out: local answer
        assert not res.redis_up
        await res.drop_replica("r")  # Redis not reachable: queued for the recovery
        await res.set_capacity("s", 2)
        assert res.skipped_writes == 2
    finally:
        redis_server.resume()
    await asyncio.wait_for(res.wait_state(True), 10)
    assert await res.match([1, 2, 3], ["r"]) == {"r": 0}
    assert res.fallbacks == 1
    assert await c.get(f"prefix-router:{{{MODEL}}}:cap:s") == b"2"
    await res.record("s", [1, 2, 3])
    assert await res.match([1, 2, 3], ["s"]) == {"s": 2}
    await res.close()


async def test_resilient_start_with_redis_down_then_up(redis_server: RedisServer) -> None:
    redis_server.kill()
    c = make_client(redis_server.url, connect_timeout=0.2)
    res = ResilientIndex(RedisIndex(c, MODEL), probe_interval_s=0.05)
    assert await res.start() is False
    await res.record("r", [1, 2])
    assert await res.match([1, 2], ["r"]) == {"r": 2}  # local, no Redis attempt
    assert res.errors == 0 and res.fallbacks == 1 and res.skipped_writes == 1
    redis_server.start()
    await asyncio.wait_for(res.wait_state(True), 10)
    assert await res.match([1, 2], ["r"]) == {"r": 0}  # shared state (empty) again
    await res.close()
    await c.aclose()


# -- bounded records (write only what changed) -----------------------------------------------


async def zadds(client: Redis) -> tuple[int, int]:
    """(ZADD calls, EVALSHA calls) so far, from Redis's own INFO commandstats."""
    stats = await client.info("commandstats")
    return (
        int(stats.get("cmdstat_zadd", {}).get("calls", 0)),
        int(stats.get("cmdstat_evalsha", {}).get("calls", 0)),
    )


@pytest.mark.parametrize("bounded", [False, True])
async def test_a_repeated_long_prompt_costs_only_what_changed(client: Redis, bounded: bool) -> None:
    idx = RedisIndex(client, MODEL, default_capacity=20_000, refresh_blocks=64 if bounded else None)
    prompt = list(range(1, 2001))  # 2,000 blocks: a ~32k-token agentic context
    zadd0, _ = await zadds(client)
    await idx.record("r", prompt)
    first = idx.written_blocks
    assert first == 2000
    rng = random.Random(0)
    for turn in range(40):
        # Other traffic in between (so the prompt's head ages), then the prompt again with a
        # few new blocks, as a conversation grows.
        for _ in range(5):
            await idx.record("r", [rng.getrandbits(64) for _ in range(50)])
        prompt += [10**7 + turn * 10 + j for j in range(3)]
        await idx.record("r", prompt)
    other = 40 * 5 * 50
    repeated = idx.written_blocks - first - other
    zadd_calls = (await zadds(client))[0] - zadd0
    assert await idx.match(prompt, ["r"]) == {"r": len(prompt)}
    if bounded:
        # New blocks (3 per turn) plus at most 64 refreshed per record; the head got stale
        # (other traffic past 1/16 of the capacity) a few times only.
        assert repeated <= 40 * (3 + 64), repeated
        assert zadd_calls <= 4 + 40 * 6, zadd_calls  # 4 chunks for the first, then 1 a record
    else:  # the exact model rewrites all ~2,000 blocks every time
        assert repeated >= 40 * 2000, repeated


@pytest.mark.parametrize("seed", range(4))
async def test_bounded_records_match_the_memory_index_while_it_fits(
    client: Redis, seed: int
) -> None:
    """A mixed workload (shared prefixes, growing and repeated prompts, forgets, drops) that
    fits the capacity: the bounded index's matches and sizes equal the in-memory index's."""
    rng = random.Random(seed)
    uni = Universe(rng)
    mem = MemoryIndex(default_capacity=10_000)
    red = RedisIndex(client, MODEL, default_capacity=10_000, refresh_blocks=4)
    for step in range(500):
        op = rng.random()
        replica = rng.choice(REPLICAS)
        if op < 0.45:
            p = uni.prompt() if rng.random() < 0.5 or not uni.prompts else rng.choice(uni.prompts)
            blocks = p[: rng.randint(1, len(p))]
            await mem.record(replica, blocks)
            await red.record(replica, blocks)
        elif op < 0.85:
            p = rng.choice(uni.prompts) if uni.prompts else uni.prompt()
            query = p + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
            cands = rng.sample(REPLICAS, rng.randint(1, len(REPLICAS)))
            assert await red.match(query, cands) == await mem.match(query, cands), step
        elif op < 0.95 and uni.prompts:
            gone = uni.subtree(rng.choice(rng.choice(uni.prompts)))
            await mem.forget(replica, gone)
            await red.forget(replica, gone)
        else:
            await mem.drop_replica(replica)
            await red.drop_replica(replica)
        for r in REPLICAS:
            assert red.size(r) == mem.size(r), step
    for p in uni.prompts:
        assert await red.match(p, REPLICAS) == await mem.match(p, REPLICAS)
    assert red.written_blocks < sum(len(p) for p in uni.prompts) * 2


@pytest.mark.parametrize("seed", range(3))
async def test_bounded_records_keep_chains_prefix_closed_under_eviction(
    client: Redis, seed: int
) -> None:
    """Under heavy trimming the bounded recency differs from exact LRU, but a chain's held
    blocks stay a prefix: the binary-search match equals a block-by-block scan of Redis."""
    rng = random.Random(seed)
    uni = Universe(rng)
    red = RedisIndex(client, MODEL, default_capacity=150, refresh_blocks=3, fresh_fraction=0.1)
    key = red.blocks_key("r")
    for _ in range(400):
        p = (
            uni.prompt(max_len=60)
            if rng.random() < 0.4 or not uni.prompts
            else rng.choice(uni.prompts)
        )
        await red.record("r", p[: rng.randint(1, len(p))])
    assert await client.zcard(key) == 150
    for p in uni.prompts:
        scores = await client.zmscore(key, [red._members([h])[0] for h in p])
        scan = next((i for i, s in enumerate(scores) if s is None), len(p))
        assert (await red.match(p, ["r"]))["r"] == scan
        held = [s for s in scores if s is not None]
        assert held == sorted(held, reverse=True)  # never more recent than an ancestor


async def test_the_bounded_record_budget_is_a_config_key(fleet, gateway, redis_server):
    from router.config import ConfigError, load_config
    from router.index.redis import DEFAULT_REFRESH_BLOCKS

    assert load_config(None, env={}).fleet.redis_refresh_blocks == DEFAULT_REFRESH_BLOCKS
    env = {"PREFIX_ROUTER_REDIS_REFRESH_BLOCKS": "16"}
    assert load_config(None, env=env).fleet.redis_refresh_blocks == 16
    with pytest.raises(ConfigError, match="redis_refresh_blocks"):
        load_config(None, env={}, redis_refresh_blocks=-1)
    (replica,) = await fleet(1, instant=True)
    for budget, expected in ((8, 8), (0, None)):  # 0: every block rewritten, as before
        gw = await gateway([replica.url], redis_url=redis_server.url, redis_refresh_blocks=budget)
        assert gw.gateway.index.primary.refresh_blocks == expected


async def test_each_model_has_its_own_keys_and_a_mixed_match_asks_each(client: Redis) -> None:
    """A replica's keys carry the model it serves (``model_of``), whichever gateway writes
    them; a replica whose model is unknown uses the default tag, and one that left the fleet
    is still dropped under its model's keys."""
    serving = {REPLICAS[0]: "org/a", REPLICAS[1]: "org/b"}
    idx = RedisIndex(client, "unknown", model_of=serving.get)
    other = RedisIndex(client, "something-else", model_of=serving.get)  # another gateway
    await idx.record(REPLICAS[0], [1, 2, 3])
    await idx.record(REPLICAS[1], [1, 2])
    await idx.record(REPLICAS[2], [1])
    assert (
        idx.blocks_key(REPLICAS[0])
        == key_prefix("prefix-router", "org/a") + "blocks:" + (REPLICAS[0])
    )
    assert await client.zcard(key_prefix("prefix-router", "org/b") + "blocks:" + REPLICAS[1]) == 2
    assert await client.zcard(key_prefix("prefix-router", "unknown") + "blocks:" + REPLICAS[2]) == 1
    assert await other.match([1, 2, 3], REPLICAS[:2]) == {REPLICAS[0]: 3, REPLICAS[1]: 2}
    del serving[REPLICAS[0]]  # removed from the fleet: its model is remembered
    await idx.drop_replica(REPLICAS[0])
    assert await client.exists(key_prefix("prefix-router", "org/a") + "blocks:" + REPLICAS[0]) == 0
