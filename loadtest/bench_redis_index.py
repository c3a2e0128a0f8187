"""Micro-benchmark: PrefixIndex match/record latency, Redis vs memory, side by side.

    python -m loadtest.bench_redis_index                # spawns a throwaway redis-server
    python -m loadtest.bench_redis_index --redis-url redis://host:6379/0

Each replica is pre-filled with ``--prompts`` prompts of ``--blocks`` blocks that share a
common head (a system prompt), so that a match does real work on every candidate: the replica
that served the prompt holds all of it, the others only the shared head. Latency is measured
per call from the caller's coroutine (what the gateway sees), at each ``--concurrency``
(concurrent callers on one event loop). The Redis server shares the machine. ``redis-bounded``
is the sorted-set layout's fleet-mode record (only new blocks plus at most
``--refresh-blocks`` refreshed; the others rewrite every block of the prompt). ``redis-map`` is
the map layout (fleet mode's default): a match is one HMGET; a record only queues (its
latency is the queueing), the queue is flushed after each timed round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from loadtest import benchkit
from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex, make_client
from router.index.redis_map import RedisMapIndex
from router.index.resilient import ResilientIndex


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_prompts(rng: random.Random, n: int, blocks: int, shared: int) -> list[list[int]]:
    head = [rng.getrandbits(64) for _ in range(shared)]
    return [head + [rng.getrandbits(64) for _ in range(blocks - shared)] for _ in range(n)]


async def fill(index: PrefixIndex, replicas: list[str], prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        await index.record(replicas[i % len(replicas)], p)


async def timed(n: int, concurrency: int, op: Callable[[int], Awaitable[Any]]) -> list[float]:
    lat: list[float] = []
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            t0 = time.perf_counter()
            await op(i)
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


@contextlib.contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    try:
        from tests.redis_server import RedisServer
    except ImportError:
        sys.exit(
            "no --redis-url given and tests/redis_server.py not importable "
            "(run from the repository root)"
        )
    with RedisServer() as server:
        yield server.url


async def run(args: argparse.Namespace, url: str) -> None:
    rng = random.Random(args.seed)
    replicas = [f"http://replica-{i}:8000" for i in range(args.replicas)]
    prompts = make_prompts(rng, args.prompts, args.blocks, args.shared)
    client = make_client(url, max_connections=max(64, 4 * max(args.concurrency)))
    await client.flushdb()
    indexes: dict[str, PrefixIndex] = {
        "memory": MemoryIndex(),
        "redis-binary": RedisIndex(client, "bench/binary", encoding="binary"),
        "redis-decimal": RedisIndex(client, "bench/decimal", encoding="decimal"),
        # fleet mode's records: only new blocks, at most --refresh-blocks old ones refreshed
        "redis-bounded": RedisIndex(client, "bench/bounded", refresh_blocks=args.refresh_blocks),
        # the map layout (fleet mode's default): writes queued, flushed after each timed round
        "redis-map": RedisMapIndex(client, "bench/map", refresh_blocks=args.refresh_blocks),
        "resilient(redis-binary)": ResilientIndex(
            RedisIndex(client, "bench/resilient"), match_timeout_s=args.timeout_ms / 1000
        ),
    }
    for index in indexes.values():
        await fill(index, replicas, prompts)
        if isinstance(index, RedisMapIndex):
            await index.flush()

    per_replica = (args.prompts // args.replicas) * (args.blocks - args.shared) + args.shared
    print(
        f"{args.replicas} replicas, {args.blocks}-block prompts ({args.shared} shared), "
        f"{args.prompts} prompts pre-filled (~{per_replica} blocks per replica), "
        f"{args.iterations} calls per cell; latency in us"
    )
    table = benchkit.Text(
        [("index", 26), ("conc", 5), ("match p50", 12), ("p99", 9), ("record p50", 13)]
        + [("p99", 9), ("local answers", 16)]
    )
    print(table.head())
    for conc in args.concurrency:
        for name, index in indexes.items():
            for _ in range(2):  # warm-up round (scripts, connections), then measure
                fallbacks = getattr(index, "fallbacks", None)
                m = await timed(
                    args.iterations,
                    conc,
                    lambda i, ix=index: ix.match(prompts[(i * 7919) % len(prompts)], replicas),
                )
                r = await timed(
                    args.iterations,
                    conc,
                    lambda i, ix=index: ix.record(
                        replicas[i % len(replicas)], prompts[(i * 104729) % len(prompts)]
                    ),
                )
                if isinstance(index, RedisMapIndex):  # its records were queued: send them
                    await index.flush()
            local = "-" if fallbacks is None else str(getattr(index, "fallbacks", 0) - fallbacks)
            us = [f"{_pct(x, q) * 1e6:.0f}" for x in (m, r) for q in (0.5, 0.99)]
            print(table.row([name, conc, *us, local]))
    print("\nblocks written to Redis per record (whole run, pre-fill included)")
    for name in ("redis-binary", "redis-bounded"):
        ix = indexes[name]
        assert isinstance(ix, RedisIndex)
        print(f"{name:<26}{ix.written_blocks / max(1, ix.records):>9.1f}")
    res = indexes["resilient(redis-binary)"]
    assert isinstance(res, ResilientIndex)
    print(
        f"\nresilient wrapper: {res.fallbacks} fallbacks, {res.match_timeouts} match timeouts "
        f"(timeout {args.timeout_ms} ms), redis_up={res.redis_up}"
    )

    # Wire and memory size of the two member encodings.
    print("\nmember encoding       bytes/block in Redis   match request bytes (250 blocks)")
    for enc in ("binary", "decimal"):
        ix = indexes[f"redis-{enc}"]
        assert isinstance(ix, RedisIndex)
        sizes = [await client.memory_usage(ix.blocks_key(r), samples=0) or 0 for r in replicas]
        members = sum([await client.zcard(ix.blocks_key(r)) for r in replicas])
        wire = sum(len(m) + 8 for m in ix._members(prompts[0]))  # + RESP framing per arg
        print(f"{enc:<22}{sum(sizes) / max(1, members):>21.1f}   {wire:>33}")
    ix = indexes["redis-map"]
    assert isinstance(ix, RedisMapIndex)
    keys = [ix.map_key(replicas[0])] + [ix.blocks_key(r) for r in replicas]
    sizes = [await client.memory_usage(k, samples=0) or 0 for k in keys]
    members = sum([await client.zcard(k) for k in keys[1:]])
    print(
        f"{'map layout':<22}{sum(sizes) / max(1, members):>21.1f}   {8 * len(prompts[0]) + 8:>33}"
    )
    info = await client.info("memory")
    print(f"(redis used_memory {info['used_memory_human']})")
    for index in indexes.values():
        if not isinstance(index, RedisIndex):
            await index.close()
    await client.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = benchkit.parser("loadtest.bench_redis_index", __doc__, seed=0)
    ap.add_argument("--redis-url", help="use this Redis (default: spawn redis-server)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=250)
    ap.add_argument("--shared", type=int, default=100, help="leading blocks all prompts share")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--timeout-ms", type=float, default=10.0)
    ap.add_argument("--refresh-blocks", type=int, default=64, help="redis-bounded's budget")
    args = ap.parse_args(argv)
    with redis_url(args.redis_url) as url:
        try:
            import uvloop
        except ImportError:
            asyncio.run(run(args, url))
        else:
            uvloop.run(run(args, url))


if __name__ == "__main__":
    main()
