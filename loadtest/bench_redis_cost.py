"""Fleet mode's cost in Redis per request, per index layout, one gateway vs several.

    python -m loadtest.bench_redis_cost                     # zsets (before) and map (after)
    python -m loadtest.bench_redis_cost --rate 6 --quick

Each run starts fresh simulated replicas and fresh gateway processes (``prefix-router serve``)
on one throwaway redis-server, resets Redis's statistics once the gateways are up, runs
``bench_fleet``'s multi-tenant workload (conversations over tenants' long system prompts,
each request sent to a gateway chosen at random), waits out one flush interval and a sync
tick, then reads ``INFO commandstats`` (which counts the commands scripts run too) and
redis-server's own CPU time. Everything Redis did in the run is counted, background work
included (index writes, sync ticks), over the requests the workload sent at the rate it
reached. Per layout and gateway count it prints: requests/s, the fleet hit rate (replicas'
own counters) and the ideal one, commands per request and the largest of them, Redis CPU per
request and what that makes of one Redis core (requests/s at 100% of it), TTFT p50.

First (``--capacity-seconds``, 0 skips it) Redis alone under ``--gateways`` simulated
gateways' index traffic (the real index classes, no gateway processes), as fast as a Python
client on this box drives it: commands per request and Redis's own CPU per request, so the
requests/s one Redis core carries for this mix (docs/fleet-mode.md, "Capacity"), for short and
long prompts (``--capacity-blocks``).

Last, ``bench_fleet``'s latency probe per layout: concurrency 1 on instant replicas, one gateway
without Redis and with it: the p50 Redis adds end to end and per routing decision.

Round trips on the request path are one per request in both layouts (the match: one EVALSHA,
or one HMGET); tests/test_redis_commands.py counts the map layout's on the gateway's sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest import bench_fleet as bf
from loadtest import benchkit
from loadtest.procs import running, start_replicas
from loadtest.runner import run_workload
from router.index.redis import RedisIndex, make_client
from router.index.redis_map import RedisMapIndex


@dataclass
class Cost:
    layout: str
    gateways: int
    requests: int
    seconds: float
    hit: float | None
    ideal: float | None
    commands: dict[str, int]
    cpu_s: float
    ttft_p50: float
    lost: int

    @property
    def per_request(self) -> float:
        return sum(self.commands.values()) / max(1, self.requests)


async def redis_counts(url: str) -> tuple[dict[str, int], float]:
    client = make_client(url)
    try:
        stats = await client.info("commandstats")
        cpu = await client.info("cpu")
    finally:
        await client.aclose()
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    for admin in ("info", "config|resetstat"):
        calls.pop(admin, None)
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def reset(url: str) -> float:
    client = make_client(url)
    try:
        await client.config_resetstat()
        cpu = await client.info("cpu")
    finally:
        await client.aclose()
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def one(a: argparse.Namespace, url: str, layout: str, n: int, seed: int) -> Cost:
    a.redis_layout = layout
    prefix = f"bench-cost-{layout}-{n}-{seed}-{int(time.time() * 1000)}"
    with running() as procs:
        reps = start_replicas(a.replicas, *bf.replica_flags(a, a.num_gpu_blocks, seed))
        procs.append(reps)
        urls = await bf.start_fleet(procs, reps.urls, n, bf.gateway_flags(a, url, prefix))
        cpu0 = await reset(url)
        target = bf.MultiGatewayTarget(urls, reps.urls, spread=a.spread, seed=seed, name=layout)
        t0 = time.perf_counter()
        result = await run_workload(
            target,
            bf.build_workload(a, "multi_tenant", seed),
            concurrency=a.concurrency,
            max_seconds=a.max_seconds,
            request_timeout_s=a.timeout,
            seed=seed,
            progress=not a.quiet,
            label=f"{layout} {n}gw seed {seed}",
        )
        seconds = time.perf_counter() - t0
        # the last flush (map layout) and a sync tick land before counting
        await asyncio.sleep(max(a.sync_interval_s, 0.1) + 0.2)
        commands, cpu1 = await redis_counts(url)
    ttfts = [r.ttft_s for r in result.records if r.ok and r.ttft_s is not None]
    return Cost(
        layout,
        n,
        len(result.records),
        seconds,
        result.fleet_hit_rate,
        result.ideal_hit_rate,
        commands,
        cpu1 - cpu0,
        float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
        result.lost,
    )


def report(costs: list[Cost]) -> None:
    print("\n== Redis cost per request (INFO commandstats: commands run by scripts included)")
    table = benchkit.Text(
        [("layout", 7), ("gw", 3), ("req", 5), ("req/s", 6), ("hit", 6), ("ideal", 6)]
        + [("cmds/req", 9), ("x base", 7), ("cpu us/req", 11), ("req/s/core", 11)]
        + [("ttft p50", 9), ("lost", 5)]
    )
    print(table.head())
    base = {c.gateways: c.per_request for c in costs if c.layout == costs[0].layout}
    for c in costs:
        us = 1e6 * c.cpu_s / max(1, c.requests)
        print(
            table.row(
                [
                    c.layout,
                    c.gateways,
                    c.requests,
                    f"{c.requests / c.seconds:.1f}",
                    bf._pct(c.hit),
                    bf._pct(c.ideal),
                    f"{c.per_request:.2f}",
                    benchkit.ratio(c.per_request, base.get(c.gateways)),
                    f"{us:.0f}",
                    f"{1e6 / us:.0f}" if us > 0 else "-",
                    f"{c.ttft_p50 * 1000:.1f}ms",
                    c.lost,
                ]
            )
        )
    print("\n   the largest commands per request:")
    for c in costs:
        top = sorted(c.commands.items(), key=lambda kv: -kv[1])[:8]
        cells = ", ".join(f"{k} {v / max(1, c.requests):.2f}" for k, v in top)
        print(f"   {c.layout:<6} {c.gateways}gw  {cells}")


async def capacity(a: argparse.Namespace, url: str, layout: str, blocks: int) -> str:
    """Redis alone under ``--gateways`` simulated gateways' index traffic, as fast as they go:
    per request a match of a ``blocks``-block prompt (a tenant's head and a new tail) over the
    replicas, then a record on the best of them (map: queued, each gateway flushing every
    ``--redis-flush-ms``). The client (Python) is the bottleneck on a small box; what counts
    is Redis's own CPU per request, whatever the rate."""
    rng = random.Random(a.seed)
    tail = max(1, blocks // 20)
    heads = [[rng.getrandbits(64) for _ in range(blocks - tail)] for _ in range(5)]
    replicas = [f"http://replica-{i}:8000" for i in range(a.replicas)]
    client = make_client(url, max_connections=256)
    model = f"capacity-{layout}-{blocks}-{int(time.time() * 1000)}"
    indexes: list[Any] = [
        RedisMapIndex(client, model, refresh_blocks=64, flush_interval_s=a.redis_flush_ms / 1000)
        if layout == "map"
        else RedisIndex(client, model, refresh_blocks=64)
        for _ in range(a.gateways)
    ]
    done = 0
    deadline = 0.0

    async def worker(index: Any, seed: int) -> None:
        nonlocal done
        r = random.Random(seed)
        while time.perf_counter() < deadline:
            prompt = r.choice(heads) + [r.getrandbits(64) for _ in range(tail)]
            counts = await index.match(prompt, replicas)
            await index.record(max(counts, key=lambda u: (counts[u], r.random())), prompt)
            done += 1

    async def flusher(index: RedisMapIndex) -> None:
        while True:
            await index.due()
            await index.flush()

    flushers = [asyncio.create_task(flusher(ix)) for ix in indexes if isinstance(ix, RedisMapIndex)]
    try:
        deadline = time.perf_counter() + 1.0  # warm-up: scripts, connections, the heads
        await asyncio.gather(*(worker(ix, i) for i, ix in enumerate(indexes)))
        cpu0, done = await reset(url), 0
        t0 = time.perf_counter()
        deadline = t0 + a.capacity_seconds
        await asyncio.gather(
            *(worker(ix, 100 + i * 64 + c) for i, ix in enumerate(indexes) for c in range(8))
        )
        for ix in indexes:
            if isinstance(ix, RedisMapIndex):
                await ix.flush()
        seconds = time.perf_counter() - t0
        commands, cpu1 = await redis_counts(url)
    finally:
        await bf_cancel(flushers)
        await client.aclose()
    us = 1e6 * (cpu1 - cpu0) / max(1, done)
    per = sum(commands.values()) / max(1, done)
    return (
        f"{layout:<6} {blocks:>6}   {done / seconds:>8.0f}   {per:>9.2f}   {us:>10.1f}   "
        f"{1e6 / us if us else 0:>11.0f}"
    )


async def bf_cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run(a: argparse.Namespace) -> int:
    costs: list[Cost] = []
    with bf.redis_server(a.redis_url) as url:
        if a.capacity_seconds > 0:
            print(
                f"\n== one Redis under {a.gateways} simulated gateways' index traffic "
                f"({a.replicas} replicas, 8 callers each, {a.capacity_seconds:g} s)"
            )
            print("layout blocks   client req/s   cmds/req   cpu us/req   req/s/core")
            for blocks in a.capacity_blocks:
                for layout in a.layouts:
                    print(f"running capacity {layout} {blocks} ...", file=sys.stderr, flush=True)
                    print(await capacity(a, url, layout, blocks), flush=True)
        for layout in a.layouts:
            for n in (1, a.gateways):
                print(f"running {layout} {n}gw ...", file=sys.stderr, flush=True)
                costs.append(await one(a, url, layout, n, a.seed))
        report(costs)
        if a.latency_requests > 0:
            for layout in a.layouts:
                a.redis_layout = layout
                print(f"running the latency probe ({layout}) ...", file=sys.stderr, flush=True)
                print(f"\n-- layout {layout}")
                bf.print_latency(await bf.latency_probe(a, url), a.latency_requests)
    return 1 if any(c.lost for c in costs) else 0


def main(argv: list[str] | None = None) -> int:
    p = bf.build_parser()
    p.prog = "loadtest.bench_redis_cost"
    p.description = __doc__
    p.add_argument(
        "--layouts",
        type=lambda s: s.split(","),
        default=["zsets", "map"],
        help="index layouts to run, the first is the baseline (default zsets,map)",
    )
    p.add_argument("--quick", action="store_true", help="20 conversations, 60 probe requests")
    p.add_argument("--capacity-seconds", type=float, default=5.0, help="0: skip that section")
    p.add_argument(
        "--capacity-blocks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[80, 1000],
        help="prompt lengths (blocks) of the capacity section",
    )
    p.set_defaults(rate=6.0, conversations=60, think_time=0.2, latency_requests=200)
    a = p.parse_args(argv)
    if a.quick:
        a.conversations, a.latency_requests, a.capacity_seconds = 20, 60, 2.0
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
