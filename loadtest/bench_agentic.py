"""Agent sessions through each router, side by side: the gateway's policies and the Rust peers,
on the same closed-loop agentic workload (issue 46's table).

    python -m loadtest.bench_agentic [--seeds 0,1] [--runs ring_spill,round_robin,...] [--quick]

Runs (each on fresh simulated replicas in a subprocess, sized for agent contexts: a context
of 131072 tokens, ``--gpu-blocks`` KV blocks each):

- ``ring_spill``, ``round_robin``, ``consistent_hash``: ``prefix-router serve --policy``;
- ``vllm_router``: vllm-router ``--policy cache_aware``; ``smg``: SGLang's gateway ``smg
  launch --policy cache_aware`` (each skipped, and said so, when not installed: ``pip
  install vllm-router sglang-router``).

The workload is ``loadtest.agentic`` (``--sessions`` sessions of ``--turns`` turns, a share
speaking Anthropic's Messages API through its SDK where the router serves it: the peers serve
OpenAI's API only, so their runs send every session as chat, which the simulated replicas
render to the very same tokens). Per run: the fleet hit rate (the replicas' own counters),
the ideal (one unlimited cache over the requests in the order they were sent), TTFT p50/p99
overall and by prompt size, the prompt tokens the gateway's routing left unused
(``prefix_router_reuse_available_tokens_total`` - ``captured``: reuse some replica held that
the chosen one did not; runs whose policy reads the prefix index only), and the load
generator's CPU share (past 0.7 of a core its own delays are in the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest import benchkit, workloads
from loadtest.metrics_scrape import gateway_counters
from loadtest.procs import (
    Proc,
    free_port,
    running,
    start,
    start_gateway,
    start_replicas,
    wait_ready,
)
from loadtest.report import CONTEXT_BUCKETS
from loadtest.runner import GatewayTarget, RunResult, percentiles, run_workload

GATEWAY_RUNS = ("ring_spill", "round_robin", "consistent_hash")
PEER_RUNS = ("vllm_router", "smg")
INDEX_RUNS = ("ring_spill",)  # the gateway runs whose policy reads the prefix index
RUNS = GATEWAY_RUNS + PEER_RUNS
MAX_MODEL_LEN = 131_072
WASTE = ("reuse:available", "reuse:captured")  # metrics_scrape.gateway_counters' keys


@dataclass
class Row:
    seed: int
    run: str
    sent: int
    ok: int
    hit: float | None
    ideal: float | None
    ttft: dict[str, float]
    by_context: list[tuple[str, dict[str, float]]]
    unused_tokens: float | None  # available - captured, gateway runs
    prompt_tokens: int
    client_cpu: float
    seconds: float


def _peer(run: str, urls: list[str]) -> Proc | None:
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware"]
    if run == "vllm_router" and shutil.which("vllm-router"):
        cmd = ["vllm-router", *common, "--prometheus-port", str(free_port())]
        return start(run, [*cmd, "--worker-urls", *urls], [f"http://127.0.0.1:{port}"])
    if run == "smg" and shutil.which("smg"):
        cmd = ["smg", "launch", *common, "--worker-urls", *urls]
        # Offline: it would fetch a tokenizer from the hub at start otherwise.
        env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
        return start(run, cmd, [f"http://127.0.0.1:{port}"], env=env)
    return None


async def _reuse(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        return await gateway_counters(s, url) or {}


def _by_context(res: RunResult) -> list[tuple[str, dict[str, float]]]:
    bounds = (0, *CONTEXT_BUCKETS, None)
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        ttfts = [
            r.ttft_s * 1000
            for r in res.records
            if r.ok
            and r.ttft_s is not None
            and r.prompt_tokens is not None
            and r.prompt_tokens >= lo
            and (hi is None or r.prompt_tokens < hi)
        ]
        label = f"{lo // 1024}k-{hi // 1024}k" if hi is not None else f"{lo // 1024}k+"
        out.append((label, {**percentiles(ttfts, (50, 99)), "n": float(len(ttfts))}))
    return out


async def one_run(run: str, seed: int, a: argparse.Namespace) -> Row | None:
    sim = [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-gpu-blocks",
        str(a.gpu_blocks),
        "--prefill-tokens-per-s",
        str(a.prefill_tps),
        "--decode-tokens-per-s",
        str(a.decode_tps),
        "--seed",
        str(seed),
    ]
    kw: dict[str, Any] = dict(
        seed=seed,
        sessions=a.sessions,
        rate=a.rate,
        turns=(a.turns_min, a.turns_max),
        think_time_s=a.think_time,
        time_scale=a.time_scale,
        messages_share=a.messages_share if run in GATEWAY_RUNS else 0.0,
    )
    with running() as procs:
        replicas = start_replicas(a.replicas, *sim)
        procs.append(replicas)
        urls = replicas.urls
        if run in GATEWAY_RUNS:
            router = start_gateway(urls, "--policy", run)
            ready = "/ready"
        else:
            maybe = _peer(run, urls)
            if maybe is None:
                benchkit.progress(f"{run}: not installed (pip install vllm-router sglang-router)")
                return None
            router, ready = maybe, "/health"
        procs.append(router)
        await wait_ready(router.url, ready, proc=router)
        workload = workloads.build("agentic", **kw)
        before = await _reuse(router.url) if run in GATEWAY_RUNS else {}
        t0 = time.perf_counter()
        res = await run_workload(
            GatewayTarget(router.url, urls),
            workload,
            concurrency=a.sessions * 2,
            max_seconds=a.seconds,
            request_timeout_s=300,
            progress=False,
            label=run,
            seed=seed,
        )
        seconds = time.perf_counter() - t0
        after = await _reuse(router.url) if run in GATEWAY_RUNS else {}
    unused = None
    # The gateway counts reuse from its index's matches: a policy that never reads the index
    # (round_robin, consistent_hash) captures 0 of 0 available, which says nothing.
    if run in INDEX_RUNS and all(k in after for k in WASTE):
        delta = {k: after[k] - before.get(k, 0.0) for k in WASTE}
        unused = delta[WASTE[0]] - delta[WASTE[1]]
    return Row(
        seed,
        run,
        res.sent,
        res.ok,
        res.fleet_hit_rate,
        res.ideal.hit_rate if res.ideal is not None else None,
        res.ttft,
        _by_context(res),
        unused,
        sum(r.prompt_tokens or 0 for r in res.records if r.ok),
        res.client_cpu_s / max(1e-9, res.duration_s),
        seconds,
    )


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(rows: list[Row]) -> str:
    buckets = [label for label, _ in rows[0].by_context] if rows else []
    head = ["seed", "run", "ok / sent", "fleet hit", "ideal", "hit / ideal", "TTFT p50 ms", "p99"]
    head += [f"p50 / p99 {b}" for b in buckets]
    head += ["reuse left unused (tokens, % of prompt)", "client CPU"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r.hit / r.ideal if r.hit is not None and r.ideal else None
        cells = [
            str(r.seed),
            r.run,
            f"{r.ok} / {r.sent}",
            _f(100 * r.hit if r.hit is not None else None, "{:.1f}%"),
            _f(100 * r.ideal if r.ideal is not None else None, "{:.1f}%"),
            _f(ratio, "{:.3f}"),
            _f(1000 * r.ttft["p50"] if "p50" in r.ttft else None),
            _f(1000 * r.ttft["p99"] if "p99" in r.ttft else None),
        ]
        for _, p in r.by_context:
            cells.append(f"{_f(p.get('p50'))} / {_f(p.get('p99'))} (n={p['n']:.0f})")
        if r.unused_tokens is None:
            cells.append("-")
        else:
            share = 100 * r.unused_tokens / max(1, r.prompt_tokens)
            cells.append(f"{r.unused_tokens:,.0f} ({share:.1f}%)")
        cells.append(f"{r.client_cpu:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


async def run(a: argparse.Namespace) -> int:
    rows: list[Row] = []
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise SystemExit(f"unknown run(s) {bad}; choose from {', '.join(RUNS)}")
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name in runs:
            benchkit.progress(f"seed {seed}: {name} ...")
            row = await one_run(name, seed, a)
            if row is not None:
                rows.append(row)
                benchkit.progress(
                    f"seed {seed}: {name}: {row.ok}/{row.sent} ok in {row.seconds:.0f} s"
                )
    print(
        f"\nagentic: {a.sessions} sessions of {a.turns_min}-{a.turns_max} turns at {a.rate}/s, "
        f"think {a.think_time} s / time scale {a.time_scale}; {a.replicas} simulated replicas "
        f"(prefill {a.prefill_tps:.0f} tokens/s, decode {a.decode_tps:.0f}, {a.gpu_blocks} KV "
        f"blocks, context {MAX_MODEL_LEN}); Messages share {a.messages_share} on gateway runs\n"
    )
    print(table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--rate", type=float, default=1.0, help="session arrivals per second")
    p.add_argument("--turns-min", type=int, default=20)
    p.add_argument("--turns-max", type=int, default=60)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--messages-share", type=float, default=0.25)
    p.add_argument("--prefill-tps", type=float, default=20_000.0)
    p.add_argument("--decode-tps", type=float, default=2_000.0)
    p.add_argument("--gpu-blocks", type=int, default=32_768)
    p.add_argument("--seconds", type=float, default=240.0, help="send nothing after this")
    p.add_argument("--quick", action="store_true", help="8 sessions of 4-8 turns, one seed")
    a = p.parse_args(argv)
    if a.quick:
        a.sessions, a.turns_min, a.turns_max, a.seeds, a.seconds = 8, 4, 8, "0", 60.0
    return asyncio.run(run(a))


if __name__ == "__main__":
    raise SystemExit(main())
