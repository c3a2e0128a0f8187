"""``prefix-router demo``: the gateway against round robin, on simulated replicas, in a minute.

Starts fresh simulated vLLM replicas on loopback for each policy, runs the same multi-tenant
chat workload (same seed) through the gateway and through a round-robin balancer, and prints
the fleet prefix-cache hit rate (read from the replicas' own counters), the ideal one, TTFT and
balance side by side. No GPU, no network, no model download.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from loadtest import procs
from loadtest.runner import ClientTarget, GatewayTarget, attach_ideal, run_workload
from loadtest.sim.tokens import get_renderer
from loadtest.workloads import multi_tenant
from router.ops.command_line import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    at_least,
    positive,
    run,
)


def _row(name: str, r: Any) -> str:
    def pct(x: float | None) -> str:
        return f"{100 * x:5.1f}%" if x is not None else "   - "

    ttft = r.ttft
    bal = r.balance().get("requests_max_over_mean")
    return (
        f"{name:26} {pct(r.fleet_hit_rate):>7} {pct(r.ideal_hit_rate):>7} "
        f"{pct(r.hit_ratio):>8} {1000 * ttft.get('p50', float('nan')):9.1f} "
        f"{1000 * ttft.get('p99', float('nan')):9.1f} "
        f"{(bal if bal is not None else float('nan')):8.2f} {r.ok:5d} {r.lost:5d}"
    )


def progress(text: str) -> None:
    """A progress line on stderr (stdout keeps the table alone)."""
    print(text, file=sys.stderr, flush=True)


async def _run(a: argparse.Namespace) -> int:
    renderer = get_renderer()  # for the ideal hit rate: the same tokens vLLM would see
    sim_args = (
        "--num-gpu-blocks",
        str(a.gpu_blocks),
        "--prefill-tokens-per-s",
        str(a.prefill_tokens_per_s),
        "--decode-tokens-per-s",
        str(a.decode_tokens_per_s),
    )

    def workload() -> Any:
        return multi_tenant(
            seed=a.seed,
            tenants=a.tenants,
            conversations=a.conversations,
            rate=a.rate,
            think_time_s=a.think_time_s,
            max_tokens=24,
        )

    results = []
    for policy in a.policies.split(","):
        client = policy.startswith("client:")
        name = f"{policy.split(':', 1)[1]} (client)" if client else f"prefix-router ({policy})"
        # Fresh, cold replicas for every policy; each part in its own process, as deployed.
        started = time.monotonic()
        with procs.running() as running:
            progress(f"[{policy}] starting {a.replicas} simulated replicas ...")
            replicas = procs.start_replicas(a.replicas, *sim_args)
            running.append(replicas)
            if client:
                target: Any = ClientTarget(
                    replicas.urls, policy.split(":", 1)[1], seed=a.seed, name=name
                )
            else:
                progress(f"[{policy}] starting the gateway (loads the tokenizer) ...")
                gw = procs.start_gateway(replicas.urls, "--policy", policy)
                running.append(gw)
                await procs.wait_ready(gw.url, proc=gw)
                target = GatewayTarget(gw.url, replicas.urls, name=name)
            wl = workload()
            planned = wl.planned_requests
            progress(
                f"[{policy}] sending {min(planned, a.max_requests)} requests: the "
                f"{a.conversations} conversations' {planned} turns, capped at "
                f"{a.max_requests} requests and {a.max_seconds:g}s ..."
            )
            result = await run_workload(
                target,
                wl,
                concurrency=a.concurrency,
                max_requests=a.max_requests,
                max_seconds=a.max_seconds,
                seed=a.seed,
                progress=False,
                replica_urls=replicas.urls,
                compute_ideal=False,
                renderer=renderer,
            )
        attach_ideal(result, renderer)
        results.append((name, result))
        progress(
            f"[{policy}] done: {result.sent} sent, {result.ok} answered, {result.lost} lost, "
            f"{time.monotonic() - started:.0f}s; sending stopped: {result.stop_description()}"
        )

    print(
        f"\nmulti-tenant chat: {a.tenants} tenants, {a.conversations} conversations, "
        f"{a.replicas} replicas with {a.gpu_blocks} KV blocks each, seed {a.seed}\n"
    )
    head = (
        f"{'policy':26} {'fleet':>7} {'ideal':>7} {'captured':>8} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'max/mean':>8} {'ok':>5} {'lost':>5}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results:
        print(_row(name, r))
    (_, ours), (_, rr) = results[0], results[-1]
    if ours.fleet_hit_rate is not None and rr.fleet_hit_rate is not None:
        print(
            f"\nfleet hit rate: {100 * ours.fleet_hit_rate:.1f}% with prefix-router vs "
            f"{100 * rr.fleet_hit_rate:.1f}% with round robin; TTFT p50 "
            f"{1000 * ours.ttft.get('p50', 0):.1f} ms vs {1000 * rr.ttft.get('p50', 0):.1f} ms"
        )
    print(
        "fleet = vllm:prefix_cache_hits / queries on the replicas; ideal = one unlimited "
        "cache over the same prompts; captured = fleet / ideal; max/mean = requests per "
        "replica."
    )
    return 0 if all(r.lost == 0 for _, r in results) else 1


DESCRIPTION = """\
The gateway against round robin, on simulated replicas, in a minute or two. For each policy:
fresh simulated vLLM replicas on loopback, the same multi-tenant chat workload (same seed),
then the fleet prefix-cache hit rate (read from the replicas' own counters), the ideal one,
TTFT and balance side by side. No GPU, no network, no model download."""

CLIENT_BASELINES = ("client:round_robin", "client:random")


def check_args(a: argparse.Namespace) -> None:
    from router.schedule import policy_names

    for flag in ("replicas", "tenants", "conversations", "concurrency", "max_requests"):
        at_least("--" + flag.replace("_", "-"), getattr(a, flag), 1)
    at_least("--gpu-blocks", a.gpu_blocks, 1)
    at_least("--think-time-s", a.think_time_s, 0)
    for flag in ("rate", "max_seconds", "prefill_tokens_per_s", "decode_tokens_per_s"):
        positive("--" + flag.replace("_", "-"), getattr(a, flag))
    known = [*policy_names(), *CLIENT_BASELINES]
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    if not policies:
        raise UsageError(f"--policies is empty; give a comma list of {', '.join(known)}")
    for p in policies:
        if p not in known:
            raise UsageError(f"--policies: unknown policy {p!r}; choose from {', '.join(known)}")
    a.policies = ",".join(policies)


def main(argv: Sequence[str] | None = None) -> int:
    from router.schedule import DEFAULT_POLICY, policy_names

    p = OneLineParser(
        prog="prefix-router demo",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas per policy")
    p.add_argument(
        "--tenants", type=int, default=8, help="tenants, each with its own system prompt"
    )
    p.add_argument("--conversations", type=int, default=64, help="multi-turn conversations")
    p.add_argument("--rate", type=float, default=8.0, help="new conversations per second")
    p.add_argument(
        "--think-time-s",
        type=float,
        default=0.3,
        help="mean seconds between a conversation's turns",
    )
    p.add_argument("--concurrency", type=int, default=32, help="most requests in flight")
    p.add_argument("--max-requests", type=int, default=400, help="requests per policy")
    p.add_argument(
        "--max-seconds", type=float, default=90.0, help="stop sending after this long, per policy"
    )
    p.add_argument("--gpu-blocks", type=int, default=2048, help="KV blocks per replica")
    p.add_argument(
        "--prefill-tokens-per-s", type=float, default=50_000.0, help="each replica's prefill speed"
    )
    p.add_argument(
        "--decode-tokens-per-s", type=float, default=400.0, help="each request's decode speed"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument(
        "--policies",
        default=f"{DEFAULT_POLICY},round_robin",
        help=f"comma-separated: gateway policies ({', '.join(policy_names())}) "
        "and client-side baselines (client:round_robin, "
        "client:random); the first is compared with the last. Both defaults run through the "
        "gateway, so both pay the same proxy hop",
    )
    p.add_argument(
        "--two-models",
        metavar="LLAMA_TOKENIZER_DIR",
        default=None,
        help="instead: two models side by side behind one gateway started with no tokenizer "
        "flags (Qwen3 at block size 16, Llama 3 with the tokenizer in this directory at 32; "
        "python tools/fetch_test_tokenizers.py fetches one), per model the fleet hit rate "
        "against the ideal (loadtest/bench_multimodel.py)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="instead: prefill/decode disaggregation, aggregated serving against the gateway's "
        "P/D (2 prefill + 2 decode simulated replicas with vLLM's NixlConnector) on the same "
        "workload (loadtest/bench_pd.py)",
    )
    a = p.parse_args(argv)
    if a.pd:
        from loadtest import bench_pd

        runs = "aggregated,pd_prefix_affinity_skip"
        seconds, seed = str(a.max_seconds), str(a.seed)
        return bench_pd.main(["--quick", "--runs", runs, "--seconds", seconds, "--seed", seed])
    if a.two_models is not None:
        from loadtest import bench_multimodel

        return bench_multimodel.main(
            [
                "--llama-tokenizer",
                a.two_models,
                "--conversations",
                str(min(a.conversations, 40)),
                "--max-seconds",
                str(a.max_seconds),
                "--seed",
                str(a.seed),
            ]
        )
    return run("prefix-router demo", lambda: _main(a))


def _main(a: argparse.Namespace) -> int:
    check_args(a)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        return uvloop.run(_run(a))
    except ImportError:
        return asyncio.run(_run(a))


if __name__ == "__main__":
    sys.exit(main())
