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
from collections.abc import Sequence
from typing import Any

from loadtest import procs
from loadtest.runner import ClientTarget, GatewayTarget, attach_ideal, run_workload
from loadtest.sim.tokens import get_renderer
from loadtest.workloads import multi_tenant


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


async def run(a: argparse.Namespace) -> int:
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
        with procs.running() as running:
            replicas = procs.start_replicas(a.replicas, *sim_args)
            running.append(replicas)
            if client:
                target: Any = ClientTarget(
                    replicas.urls, policy.split(":", 1)[1], seed=a.seed, name=name
                )
            else:
                gw = procs.start_gateway(replicas.urls, "--policy", policy)
                running.append(gw)
                await procs.wait_ready(gw.url)
                target = GatewayTarget(gw.url, replicas.urls, name=name)
            print(
                f"running {name} on {a.replicas} simulated replicas ...",
                file=sys.stderr,
                flush=True,
            )
            result = await run_workload(
                target,
                workload(),
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


def main(argv: Sequence[str] | None = None) -> int:
    from router.schedule import policy_names

    p = argparse.ArgumentParser(
        prog="prefix-router demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="new conversations per second")
    p.add_argument("--think-time-s", type=float, default=0.3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--max-seconds", type=float, default=90.0)
    p.add_argument("--gpu-blocks", type=int, default=2048, help="KV blocks per replica")
    p.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    p.add_argument("--decode-tokens-per-s", type=float, default=400.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default="ttft,round_robin",
        help=f"comma-separated: gateway policies ({', '.join(policy_names())}) "
        "and client-side baselines (client:round_robin, "
        "client:random); the first is compared with the last. Both defaults run through the "
        "gateway, so both pay the same proxy hop",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        return uvloop.run(run(a))
    except ImportError:
        return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
