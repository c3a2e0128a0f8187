"""Approximate vs precise (KV events) routing under cache pressure, with a replica restart.

    python -m loadtest.bench_kv_events [--replicas 4] [--requests 600] [--blocks 600]

In one process: ``--replicas`` simulated replicas with ``--blocks`` KV blocks each (block
size 16) and one gateway; the workload is ``--tenants`` tenants with a ~1k-token shared
context each, picked at random, 8 requests in flight, so the working set is larger than the
fleet's KV memory. Halfway through, replica 0 restarts (a new process on the same ports:
empty cache, its event stream from seq 0). The same seeded workload runs twice, approximate
(placements and reported cached tokens) and precise (``kv_events`` on, the simulator
publishing vLLM's events).

Printed per mode: hit = reported cached / prompt tokens; mispredicted = (predicted -
reported) / prompt tokens, predicted from the gateway's ``x-prefix-router-cached-blocks``;
TTFT p50/p99 client-side (non-streamed: time to the whole answer; on a shared CPU the
timings are indicative, the token ratios are not).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import aiohttp

from loadtest.replica import SimConfig, SimReplica
from router.app import start_gateway
from router.bundled import tokenizer_dir
from router.config import load_config
from router.prompt import Renderer

EVENTS = {
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
}


async def run(precise: bool, args: argparse.Namespace, renderer: Renderer) -> dict[str, float]:
    reference = Renderer(renderer.tokenizer, segment_cache=False)
    sims = []
    for _ in range(args.replicas):
        cfg = SimConfig(
            num_gpu_blocks=args.blocks,
            prefill_tokens_per_s=50_000,
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
    config = load_config(
        env={},
        replicas=[s.url for s in sims],
        health_interval_s=0.5,
        metrics_interval_s=0.5,
        **extra,
    )
    gw = await start_gateway(config, renderer, port=0)
    rng = random.Random(args.seed)
    contexts = [f"Tenant {t} shared context. " * 120 for t in range(args.tenants)]
    predicted = reported = prompt = 0
    ttfts: list[float] = []
    try:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                nonlocal predicted, reported, prompt
                body = {
                    "model": "Qwen/Qwen3-0.6B",
                    "max_tokens": 8,
                    "messages": [
                        {"role": "system", "content": rng.choice(contexts)},
                        {"role": "user", "content": f"question {i}"},
                    ],
                }
                t0 = time.perf_counter()
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    answer = await resp.json()
                ttfts.append(time.perf_counter() - t0)
                predicted += int(resp.headers["x-prefix-router-cached-blocks"]) * 16
                usage = answer["usage"]
                reported += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]

            for i in range(0, args.requests, 8):
                if i == args.requests // 2 // 8 * 8:
                    await sims[0].stop()
                    await sims[0].start(port=sims[0].port)
                await asyncio.gather(*(one(i + k) for k in range(8)))
    finally:
        await gw.stop()
        for s in sims:
            await s.stop()
    ttfts.sort()
    return {
        "hit": reported / prompt,
        "mispredicted": (predicted - reported) / prompt,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)],
    }


async def main_async(args: argparse.Namespace) -> None:
    renderer = await asyncio.to_thread(Renderer.from_pretrained, str(tokenizer_dir()))
    print(f"{'mode':<12}{'hit':>8}{'mispred':>10}{'p50 s':>8}{'p99 s':>8}")
    for precise in (False, True):
        r = await run(precise, args, renderer)
        print(
            f"{'precise' if precise else 'approximate':<12}{r['hit']:>8.3f}"
            f"{r['mispredicted']:>+10.3f}{r['ttft_p50_s']:>8.3f}{r['ttft_p99_s']:>8.3f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_kv_events", description=__doc__)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=600, help="KV blocks per replica")
    p.add_argument("--tenants", type=int, default=40)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
