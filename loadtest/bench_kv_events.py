"""Approximate vs precise (KV events) routing under cache pressure, several gateways sharing
one Redis (fleet mode), replicas restarted mid-run.

    python -m loadtest.bench_kv_events [--gateways 3] [--replicas 4] [--blocks 400]
                                       [--tenants 40] [--requests 480] [--restarts 1]
                                       [--outages 1] [--rejections 24]

In one process: a throwaway redis-server, ``--replicas`` simulated replicas with ``--blocks``
KV blocks each (block size 16, prefill at ``--prefill-tps`` tokens/s, so TTFT follows the
uncached tokens) and ``--gateways`` gateways in fleet mode; every request goes to a random
gateway (the hard case: consecutive requests of a tenant rarely reach the same gateway). The
workload is ``--tenants`` tenants with a ~700-token shared context each, picked at random,
``--concurrency`` requests in flight, streamed: the working set (tenants x context blocks) is
larger than the fleet's KV memory. The fault schedule, spread over the run: ``--restarts``
times a replica restarts (a new process on the same ports: empty cache, its event stream from
seq 0); ``--outages`` times a replica's publisher is cut off for ``--outage-batches`` rounds of
requests (its engine goes on; precise mode routes that replica on the approximate model
meanwhile, then catches up); ``--rejections`` requests are refused by their replica with a
400 before it computes anything (excluded from the figures below). The same seeded
workload runs in three modes: approximate with the old full-prompt records (``refresh_blocks``
off: every record rewrites every block, as before), approximate with bounded records (the
fleet-mode default), and precise (``kv_events`` on; one gateway per replica stream writes).

Printed per mode: hit = reported cached / prompt tokens; ideal = what one unlimited cache
would have hit on the same arrival order; mispredicted = (predicted - reported) / prompt
tokens, predicted from ``x-prefix-router-cached-blocks`` (negative: the gateway expected less
than the replica had); TTFT p50/p99 client-side to the first streamed chunk; Redis blocks
written per request (members the record scripts wrote, all gateways) and Redis commands per
request (INFO commandstats, everything: lookups, writes, sync ticks, leases); for precise, the
event batches written to Redis against those applied, over all gateways (without ownership
every gateway would write each one: ratio = the number of gateways).

On 2 shared cores keep it small (the defaults take a few minutes for the three modes); on a
bigger box raise ``--requests``, ``--tenants`` and ``--blocks`` together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from loadtest import benchkit
from loadtest.replica import SimConfig, SimReplica
from router.config import load_config
from router.core.bundled import tokenizer_dir
from router.http.app import start_gateway
from router.prompt import Renderer
from tests.redis_server import RedisServer

MODEL = "Qwen/Qwen3-0.6B"
EVENTS = {
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
}
MODES = ("approx-full", "approximate", "precise")


def bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    contexts = [f"Tenant {t} shared context. " * args.context_repeats for t in range(args.tenants)]
    return [
        {
            "model": MODEL,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "system", "content": rng.choice(contexts)},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        for i in range(args.requests)
    ]


async def redis_calls(client: Any) -> int:
    stats = await client.info("commandstats")
    return sum(int(v.get("calls", 0)) for k, v in stats.items() if k != "cmdstat_info")


async def run(mode: str, args: argparse.Namespace, renderer: Renderer) -> dict[str, float]:
    precise = mode == "precise"
    reference = Renderer(renderer.tokenizer, segment_cache=False)
    redis = RedisServer().start()
    sims: list[SimReplica] = []
    gws: list[Any] = []
    try:
        for _ in range(args.replicas):
            cfg = SimConfig(
                num_gpu_blocks=args.blocks,
                prefill_tokens_per_s=args.prefill_tps,
                **(EVENTS if precise else {}),
            )
            sim = SimReplica(cfg, renderer=reference)
            await sim.start()
            sims.append(sim)
        extra: dict[str, Any] = {}
        if precise:
            extra = {
                "kv_events": True,
                "kv_events_endpoints": {
                    s.url: {
                        "endpoint": s.kv_events.endpoint,
                        "replay_endpoint": s.kv_events.replay_endpoint,
                    }
                    for s in sims
                },
            }
        for _ in range(args.gateways):
            config = load_config(
                env={},
                replicas=[s.url for s in sims],
                health_interval_s=0.5,
                metrics_interval_s=0.5,
                redis_url=redis.url,
                sync_interval_s=0.5,
                redis_timeout_ms=args.redis_timeout_ms,
                **extra,
            )
            gw = await start_gateway(config, renderer, port=0)
            if mode == "approx-full":  # the old record: every block of the prompt, each time
                gw.gateway.index.primary.refresh_blocks = None
            gws.append(gw)
        return await drive(args, sims, gws, precise)
    finally:
        for gw in gws:
            await gw.stop()
        for s in sims:
            await s.stop()
        redis.close()


def primary_of(gw: Any) -> Any:
    index = gw.gateway.index
    return getattr(index, "inner", index).primary


async def drive(
    args: argparse.Namespace, sims: list[SimReplica], gws: list[Any], precise: bool
) -> dict[str, float]:
    rng = random.Random(args.seed + 1)
    work = bodies(args)
    seen: set[int] = set()  # the ideal: one unlimited cache
    predicted = reported = prompt = ideal = 0
    ttfts: list[float] = []
    client = primary_of(gws[0]).client
    calls0 = await redis_calls(client)
    written0 = sum(primary_of(g).written_blocks for g in gws)
    rounds = list(range(0, len(work), args.concurrency))

    def spread(n: int, offset: float = 0.0) -> dict[int, int]:
        """Round start -> fault number k, for n faults spread over the run."""
        return {
            rounds[min(len(rounds) - 1, int(len(rounds) * (k + 1 + offset) / (n + 1)))]: k
            for k in range(n)
        }

    restart_at = spread(args.restarts)
    outage_at = spread(args.outages, offset=-0.5)
    reject_at = spread(args.rejections, offset=0.25)
    resume_at: dict[int, SimReplica] = {}
    rejected = 0

    async with aiohttp.ClientSession() as session:

        async def one(body: dict[str, Any]) -> None:
            nonlocal predicted, reported, prompt, ideal
            nonlocal rejected
            raw = json.dumps(body).encode()
            rr = await gws[0].gateway.path.prepare(raw, {}, "chat", "bench")
            run_ = 0
            while run_ < len(rr.block_hashes) and rr.block_hashes[run_] in seen:
                run_ += 1
            gw = rng.choice(gws)
            t0 = time.perf_counter()
            first = None
            usage: dict[str, Any] = {}
            async with session.post(
                gw.url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status == 400 and b"Simulated failure" in await resp.read():
                    rejected += 1  # the replica refused it: it computed nothing
                    return
                assert resp.status == 200, await resp.text()
                seen.update(rr.block_hashes)
                blocks = int(resp.headers["x-prefix-router-cached-blocks"])
                async for line in resp.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
            ttfts.append(first or 0.0)
            tokens = usage["prompt_tokens"]
            predicted += blocks * 16
            reported += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt += tokens
            ideal += min(run_, (tokens - 1) // 16) * 16

        for n, i in enumerate(rounds):
            if i in restart_at:
                sim = sims[restart_at[i] % len(sims)]
                await sim.stop()
                await sim.start(port=sim.port)
            if i in outage_at and precise:
                sim = sims[(outage_at[i] + 1) % len(sims)]
                assert sim.kv_events is not None
                await sim.kv_events.pause()
                resume_at[rounds[min(len(rounds) - 1, n + args.outage_batches)]] = sim
            if i in resume_at:
                pub = resume_at.pop(i).kv_events
                assert pub is not None
                await pub.resume()
            if i in reject_at:
                rng.choice(sims).fail_next(1, 400)
            await asyncio.gather(*(one(b) for b in work[i : i + args.concurrency]))
        for sim in resume_at.values():
            assert sim.kv_events is not None
            await sim.kv_events.resume()
    for g in gws:
        while g.gateway._background:
            await asyncio.gather(*list(g.gateway._background), return_exceptions=True)
    n = len(work) - rejected
    calls = await redis_calls(client) - calls0 - 1
    written = sum(primary_of(g).written_blocks for g in gws) - written0
    applied = shared = 0
    if precise:
        for g in gws:
            for s in g.gateway.kv_events.streams.values():
                applied += s.batches
                shared += s.shared_batches
    ttfts.sort()
    return {
        "hit": reported / prompt,
        "ideal": ideal / prompt,
        "mispredicted": (predicted - reported) / prompt,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)],
        "blocks_per_req": written / n,
        "cmds_per_req": calls / n,
        "event_batches_applied": applied,
        "event_batches_shared": shared,
        "rejected": rejected,
    }


async def main_async(args: argparse.Namespace) -> None:
    renderer = await asyncio.to_thread(Renderer.from_pretrained, str(tokenizer_dir()))
    print(
        f"{args.gateways} gateways, {args.replicas} replicas x {args.blocks} blocks, "
        f"{args.tenants} tenants, {args.requests} requests; faults: {args.restarts} restarts, "
        f"{args.outages} publisher outages of {args.outage_batches} rounds, "
        f"{args.rejections} rejections",
        flush=True,
    )
    table = benchkit.Text(
        [("mode", 12), ("hit", 7), ("ideal", 7), ("/ideal", 7), ("mispred", 9), ("p50 s", 8)]
        + [("p99 s", 8), ("blk/req", 9), ("cmd/req", 9), ("rej", 5)]
        + [("  events written/applied", 0, "<")]
    )
    print(table.head())
    for mode in args.modes:
        r = await run(mode, args, renderer)
        events = (
            f"{r['event_batches_shared']:.0f}/{r['event_batches_applied']:.0f}"
            if mode == "precise"
            else "-"
        )
        cells = [mode, f"{r['hit']:.3f}", f"{r['ideal']:.3f}", benchkit.ratio(r["hit"], r["ideal"])]
        cells += [f"{r['mispredicted']:+.3f}", f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}"]
        cells += [f"{r['blocks_per_req']:.1f}", f"{r['cmds_per_req']:.1f}", f"{r['rejected']:.0f}"]
        print(table.row([*cells, f"  {events}"]), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = benchkit.parser("loadtest.bench_kv_events", __doc__, seed=1, whole_doc=True)
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=400, help="KV blocks per replica")
    p.add_argument("--tenants", type=int, default=40)
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--context-repeats",
        type=int,
        default=120,
        help="the shared context's sentence repeated this often (120: ~700 tokens, ~45 blocks)",
    )
    p.add_argument("--restarts", type=int, default=1, help="replica restarts during the run")
    p.add_argument("--outages", type=int, default=1, help="publisher outages (precise mode)")
    p.add_argument(
        "--outage-batches", type=int, default=8, help="rounds of requests an outage lasts"
    )
    p.add_argument(
        "--rejections", type=int, default=24, help="requests the replica refuses with a 400"
    )
    p.add_argument("--prefill-tps", type=float, default=20_000, help="simulated prefill rate")
    p.add_argument(
        "--redis-timeout-ms",
        type=float,
        default=50.0,
        help="Redis lookup timeout (the default 10 ms trips often on a loaded 2-core box)",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
