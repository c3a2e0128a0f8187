"""The pressure benchmark: issue 15's scenario in simulated time, through the router's policies.

    python -m loadtest.bench_pressure [--seeds 3] [--policies ttft,sticky_prefix,round_robin]

Each seed builds the ``pressure`` workload (loadtest/pressure.py) and replays it through a
simulated fleet (loadtest/pressure_sim.py) once per policy; the table pools every seed's
requests. hit/ideal is the fleet's prefix-cache hit rate over what one unlimited cache would
reuse on the same arrivals (loadtest/ideal.py); balance is max/mean requests per replica;
the last two columns are the ratios against the sticky baseline (target: hit/ideal >= 98% and
p99 <= 0.3x sticky's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from loadtest import benchkit
from loadtest.pressure import PressureParams, conversations
from loadtest.pressure_sim import FleetParams, RunResult, Sim
from router.schedule import policy_names

BASELINE = "sticky_prefix"
DEFAULT_POLICIES = ("ttft", "sticky_prefix", "round_robin", "ring_spill")


@dataclass
class Row:
    policy: str
    hit_over_ideal: float
    hit_rate: float
    p50: float
    p90: float
    p99: float
    balance: float
    spills: int
    evictions: int
    requests: int
    per_seed: list[tuple[float, float]]  # (hit/ideal, p99 s) of each seed


def pool(results: Sequence[RunResult]) -> Row:
    ttft = np.array([r.t_first - r.t_send for res in results for r in res.reqs])
    hits = sum(r.hits for r in results)
    queries = sum(r.queries for r in results)
    ideal = sum(r.ideal_hits for r in results) / sum(r.ideal_queries for r in results)
    balance = float(
        np.mean(
            [max(r.per_replica.values()) / np.mean(list(r.per_replica.values())) for r in results]
        )
    )
    p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99]))
    return Row(
        results[0].policy,
        hits / queries / ideal,
        hits / queries,
        p50,
        p90,
        p99,
        balance,
        sum(r.reasons.get("spill", 0) for r in results),
        sum(r.evictions for r in results),
        len(ttft),
        [(_hit_over_ideal(r), _p99(r)) for r in results],
    )


def _hit_over_ideal(r: RunResult) -> float:
    return r.hits / r.queries / (r.ideal_hits / r.ideal_queries)


def _p99(r: RunResult) -> float:
    return float(np.percentile([q.t_first - q.t_send for q in r.reqs], 99))


def table(rows: Sequence[Row]) -> str:
    base = next((r for r in rows if r.policy == BASELINE), None)
    columns = [
        ("policy", 16),
        ("hit/ideal", 10),
        ("hit", 7),
        ("p50 s", 8),
        ("p90 s", 8),
        ("p99 s", 8),
        ("balance", 9),
        ("spills", 8),
        ("evicted", 9),
        ("hit/sticky", 11),
        ("p99/sticky", 11),
    ]
    cells = [
        (
            r.policy,
            f"{r.hit_over_ideal:.1%}",
            f"{r.hit_rate:.1%}",
            f"{r.p50:.2f}",
            f"{r.p90:.2f}",
            f"{r.p99:.2f}",
            f"{r.balance:.2f}",
            r.spills,
            r.evictions,
            benchkit.ratio(r.hit_over_ideal, base.hit_over_ideal) if base else "-",
            benchkit.ratio(r.p99, base.p99) if base else "-",
        )
        for r in rows
    ]
    lines = [benchkit.text(columns, cells), "per seed (hit/ideal, p99 s):"]
    for r in rows:
        seeds = "  ".join(f"{h:.1%} {p:.2f}" for h, p in r.per_seed)
        lines.append(f"  {r.policy:<14}{seeds}")
    return "\n".join(lines)


def run(
    policies: Sequence[str], seeds: Sequence[int], wp: PressureParams, fp: FleetParams
) -> list[Row]:
    per: dict[str, list[RunResult]] = {p: [] for p in policies}
    for seed in seeds:
        convs = conversations(replace(wp, seed=seed))
        for p in policies:
            per[p].append(Sim(convs, p, fp).run())
    return [pool(per[p]) for p in policies]


def main(argv: Sequence[str] | None = None) -> int:
    ap = benchkit.parser("loadtest.bench_pressure", __doc__, whole_doc=True)
    ap.add_argument("--seeds", type=int, default=3, help="N seeds, pooled")
    ap.add_argument("--first-seed", type=int, default=0, help="the first seed")
    ap.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, from: {', '.join(policy_names())}",
    )
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1024, help="KV blocks per replica")
    ap.add_argument("--prefill-tps", type=float, default=1500.0, help="prefill tokens/s")
    ap.add_argument(
        "--decode-cost",
        type=float,
        default=4.0,
        help="replica time one output token takes, in prefill tokens (decode load)",
    )
    ap.add_argument("--tpot", type=float, default=0.02, help="seconds per output token")
    ap.add_argument(
        "--gateways", type=int, default=1, help="gateways sharing the index (fleet mode)"
    )
    ap.add_argument("--sync-interval", type=float, default=0.5, help="their load sync interval, s")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=480)
    ap.add_argument("--rate", type=float, default=4.0, help="conversations/s")
    ap.add_argument("--skew", type=float, default=1.25, help="Zipf exponent of tenants")
    a = ap.parse_args(argv)
    policies = benchkit.subset(a.policies, policy_names(), "policy")
    wp = PressureParams(
        tenants=a.tenants, conversations=a.conversations, rate=a.rate, tenant_skew=a.skew
    )
    fp = FleetParams(
        replicas=a.replicas,
        num_blocks=a.blocks,
        prefill_tps=a.prefill_tps,
        tpot_s=a.tpot,
        decode_cost_tokens=a.decode_cost,
        gateways=a.gateways,
        sync_interval_s=a.sync_interval,
    )
    t0 = time.process_time()
    rows = run(policies, range(a.first_seed, a.first_seed + a.seeds), wp, fp)
    print(
        f"pressure: {a.replicas} replicas x {a.blocks} blocks x 16 tokens, prefill "
        f"{a.prefill_tps:g} tok/s (decode {a.decode_cost:g} tok-eq/token), {a.tenants} tenants Zipf {a.skew}, {a.conversations} "
        f"4-turn conversations at {a.rate}/s; {a.gateways} gateway(s); "
        f"seeds {a.first_seed}..{a.first_seed + a.seeds - 1} pooled"
    )
    print(table(rows))
    print(f"({time.process_time() - t0:.1f} s CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
