"""Flow control against a noisy neighbour: quiet tenants' time to first token while one tenant
floods the fleet, with flow control off and on (issue 32).

    python -m loadtest.bench_flow [--seed 0] [--quick] [--runs baseline,off,on]

Simulated replicas run in one subprocess (``loadtest.procs``); each run starts a fresh
``prefix-router serve`` subprocess (default policy) from a temporary ``--config`` YAML and
resets the replicas' caches, and the load-test harness drives the ``noisy_neighbour``
workload through it (``loadtest.noisy``): 7 quiet tenants at a steady rate using ~40% of
the fleet's prefill, and one tenant flooding open-loop at 30x a quiet tenant's rate during
the middle phase, so the fleet is offered ~2x its capacity.

Runs (the quiet tenants send the very same requests in each):

- ``baseline``  no flood, flow control off: the quiet tenants' TTFT without a neighbour;
- ``off``       the flood, flow control off (main's behaviour);
- ``on``        the flood, flow control on;
- ``on-idle``   no flood, flow control on: what flow control costs when nothing saturates.

Printed per run and phase (before / during / after the flood): the quiet tenants' TTFT
p50/p99 (client-side, streamed), their 429s and other errors; the flooder's TTFT p50/p99,
requests ok and shed (429); fleet hit rate (replicas' own counters) against the ideal of
the requests served; requests lost (no answer at all). Then the targets: quiet p99 during
the flood over the baseline's p99 of the same phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from loadtest import benchkit
from loadtest.noisy import FLOODER, TENANT_HEADER, NoisyParams, noisy_workload, quiet_names
from loadtest.procs import running, start_gateway, start_replicas, wait_ready
from loadtest.runner import GatewayTarget, RequestRecord, RunResult, run_workload
from loadtest.workloads import pressure

RUNS = ("baseline", "off", "on", "on-idle")
PHASES = ("before", "during", "after")


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.post(u + "/reset_prefix_cache") as resp:
                resp.raise_for_status()


def gateway_config(tmp: Path, run: str, p: NoisyParams) -> Path:
    config: dict[str, Any] = {
        "log_level": "warning",
        "tenant_header": TENANT_HEADER,
        "flow_control": run.startswith("on"),
        # every tenant the same weight and band: fairness alone has to protect the quiet ones
        "tenants": {t: {"weight": 1} for t in [*quiet_names(p), FLOODER]},
    }
    path = tmp / f"gateway-{run}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


async def run_one(
    run: str, replica_urls: list[str], tmp: Path, p: NoisyParams, args: argparse.Namespace
) -> RunResult:
    flood = run in ("off", "on")
    params = NoisyParams(**{**p.__dict__, "flood_factor": p.flood_factor if flood else 0.0})
    workload = noisy_workload(params)
    max_seconds = params.duration_s + 1.0
    if args.workload == "pressure":  # one tenant's view of a busy fleet: what on costs
        workload = pressure(seed=args.seed, conversations=args.conversations)
        max_seconds = args.conversations / 4.0 + 60.0
    await reset_caches(replica_urls)
    with running() as procs:
        gw = start_gateway(replica_urls, "--config", str(gateway_config(tmp, run, p)))
        procs.append(gw)
        await wait_ready(gw.url, "/ready", proc=gw)
        return await run_workload(
            GatewayTarget(gw.url, replica_urls, policy="default", name=run),
            workload,
            concurrency=args.concurrency,
            max_seconds=max_seconds,
            request_timeout_s=args.timeout,
            progress=False,
            label=run,
        )


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarise(result: RunResult, p: NoisyParams) -> dict[str, Any]:
    sent = [r for r in result.records if r.sent_s is not None]
    quiet = [r for r in sent if r.group != FLOODER]
    flood = [r for r in sent if r.group == FLOODER]

    def ttfts(rs: list[RequestRecord]) -> list[float]:
        return [r.ttft_s for r in rs if r.ok and r.ttft_s is not None]

    row: dict[str, Any] = {"run": result.label}
    for phase in PHASES:
        rs = [r for r in quiet if p.phase(r.scheduled_s) == phase]
        t = ttfts(rs)
        row[f"quiet_{phase}"] = {
            "n": len(rs),
            "ok": sum(r.ok for r in rs),
            "p50": pct(t, 50),
            "p99": pct(t, 99),
        }
    row["quiet_429"] = sum(1 for r in quiet if r.status == 429)
    row["quiet_errors"] = sum(1 for r in quiet if not r.ok)
    row["flood_sent"] = len(flood)
    row["flood_ok"] = sum(r.ok for r in flood)
    row["flood_429"] = sum(1 for r in flood if r.status == 429)
    row["flood_p50"] = pct(ttfts(flood), 50)
    row["flood_p99"] = pct(ttfts(flood), 99)
    row["other_errors"] = sum(1 for r in flood if not r.ok and r.status != 429) + sum(
        1 for r in quiet if not r.ok
    )
    row["lost"] = result.lost
    row["fleet_hit"] = result.fleet_hit_rate
    row["ideal_hit"] = result.ideal_hit_rate
    row["hit_ratio"] = result.hit_ratio
    row["duration_s"] = result.duration_s
    row["errors_by_status"] = result.errors_by_status
    return row


def pressure_row(result: RunResult) -> dict[str, Any]:
    sent = [r for r in result.records if r.sent_s is not None]
    t = [r.ttft_s for r in sent if r.ok and r.ttft_s is not None]
    ok = sum(r.ok for r in sent)
    return {
        "run": result.label,
        "ok": ok,
        "sent": len(sent),
        "duration_s": result.duration_s,
        "throughput": ok / result.duration_s if result.duration_s else math.nan,
        "p50": pct(t, 50),
        "p99": pct(t, 99),
        "fleet_hit": result.fleet_hit_rate,
        "ideal_hit": result.ideal_hit_rate,
        "hit_ratio": result.hit_ratio,
        "errors": dict(result.errors_by_status),
        "lost": result.lost,
    }


def pressure_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| run | ok / sent | seconds | ok req/s | TTFT p50 / p99 ms | fleet hit | ideal "
        "| hit / ideal | errors | lost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = "n/a" if r["fleet_hit"] is None else f"{100 * r['fleet_hit']:.1f}%"
        ideal = "n/a" if r["ideal_hit"] is None else f"{100 * r['ideal_hit']:.1f}%"
        ratio = "n/a" if r["hit_ratio"] is None else f"{r['hit_ratio']:.3f}"
        out.append(
            f"| {r['run']} | {r['ok']} / {r['sent']} | {r['duration_s']:.0f} | "
            f"{r['throughput']:.2f} | {ms(r['p50'])} / {ms(r['p99'])} | {hit} | {ideal} | "
            f"{ratio} | {r['errors'] or 0} | {r['lost']} |"
        )
    return "\n".join(out)


def ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v * 1000:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        phases = [f"{ms(r[f'quiet_{ph}']['p50'])} / {ms(r[f'quiet_{ph}']['p99'])}" for ph in PHASES]
        flood = f"{ms(r['flood_p50'])} / {ms(r['flood_p99'])}" if r["flood_sent"] else "-"
        cells.append(
            (
                r["run"],
                *phases,
                r["quiet_429"],
                flood,
                f"{r['flood_ok']} / {r['flood_429']} / {r['flood_sent']}",
                benchkit.pct(r["fleet_hit"]),
                benchkit.pct(r["ideal_hit"]),
                "n/a" if r["hit_ratio"] is None else f"{r['hit_ratio']:.3f}",
                r["other_errors"],
                r["lost"],
            )
        )
    return benchkit.markdown(
        "run | quiet p50 / p99 ms before | during | after | quiet 429 | flooder p50 / p99 ms | "
        "flooder ok / 429 / sent | fleet hit | ideal | hit / ideal | other errors | lost",
        cells,
    )


def targets(rows: list[dict[str, Any]]) -> list[str]:
    by = {r["run"]: r for r in rows}
    base = by.get("baseline")
    out = []
    for run in ("off", "on"):
        r = by.get(run)
        if r is None or base is None:
            continue
        ratio = r["quiet_during"]["p99"] / base["quiet_during"]["p99"]
        out.append(
            f"{run}: quiet p99 during the flood {ms(r['quiet_during']['p99'])} ms = "
            f"{ratio:.2f}x the baseline's {ms(base['quiet_during']['p99'])} ms (target <= 1.5, "
            f"aim 1.3); quiet 429s {r['quiet_429']} (target 0); hit/ideal "
            f"{r['hit_ratio'] if r['hit_ratio'] is None else round(r['hit_ratio'], 3)} "
            f"(target >= 0.95); lost {r['lost']}, errors other than the flooder's 429s "
            f"{r['other_errors']} (target 0)"
        )
    if "on-idle" in by and base is not None:
        idle = by["on-idle"]
        out.append(
            f"on-idle: quiet p50 / p99 over the whole run without a flood, flow control on vs "
            f"off: {ms(idle['quiet_during']['p50'])} / {ms(idle['quiet_during']['p99'])} ms vs "
            f"{ms(base['quiet_during']['p50'])} / {ms(base['quiet_during']['p99'])} ms"
        )
    return out


async def amain(args: argparse.Namespace, trace: list[str]) -> list[dict[str, Any]]:
    """The runs' rows; ``trace`` gets a JSON line per request (for --trace)."""
    runs = benchkit.subset(args.runs, RUNS, "run")
    p = NoisyParams(
        seed=args.seed,
        quiet_rate=args.quiet_rate,
        flood_factor=args.flood_factor,
        before_s=args.before,
        flood_s=args.flood,
        after_s=args.after,
        question_tokens=args.question_tokens,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmp, running() as procs:
        sim = start_replicas(
            args.replicas,
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
            "--prefill-tokens-per-s",
            str(args.prefill_tokens_per_s),
            "--decode-tokens-per-s",
            str(args.decode_tokens_per_s),
        )
        procs.append(sim)
        for run in runs:
            result = await run_one(run, sim.urls, Path(tmp), p, args)
            if args.workload == "pressure":
                rows.append(pressure_row(result))
                print(f"{run}: {rows[-1]}", file=sys.stderr, flush=True)
                continue
            row = summarise(result, p)
            rows.append(row)
            for rec in result.records if args.trace else []:
                d = rec.to_json()
                d.update(run=run, phase=p.phase(rec.scheduled_s))
                trace.append(json.dumps(d) + "\n")
            print(
                f"{run}: {result.sent} sent in {result.duration_s:.0f} s, quiet during p99 "
                f"{ms(row['quiet_during']['p99'])} ms, flooder 429 {row['flood_429']}, "
                f"errors {row['errors_by_status']}, lost {row['lost']}",
                file=sys.stderr,
                flush=True,
            )
    if args.workload == "pressure":
        print(
            f"Workload: {pressure(seed=args.seed, conversations=args.conversations).description}."
        )
        print(
            f"{args.replicas} simulated replicas (prefill {args.prefill_tokens_per_s:g} "
            f"tokens/s, decode {args.decode_tokens_per_s:g} tokens/s); seed {args.seed}.\n"
        )
        print(pressure_table(rows))
        return rows
    quiet_load = p.quiet_tenants * p.quiet_rate * p.question_tokens
    capacity = args.replicas * args.prefill_tokens_per_s
    print(f"Workload: {noisy_workload(p).description}.")
    print(
        f"{args.replicas} simulated replicas (prefill {args.prefill_tokens_per_s:g} tokens/s, "
        f"decode {args.decode_tokens_per_s:g} tokens/s, {args.num_gpu_blocks} blocks); quiet "
        f"tenants offer {quiet_load / capacity:.0%} of the fleet's prefill, the flood "
        f"{p.flood_factor * quiet_load / p.quiet_tenants / capacity:.0%}; seed {args.seed}.\n"
    )
    print(table(rows))
    print()
    for line in targets(rows):
        print(line)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser(
        "loadtest.bench_flow", __doc__, seed=0, quick="5 / 10 / 5 s phases (a smoke run)", json=True
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--prefill-tokens-per-s", type=float, default=560.0)
    p.add_argument("--decode-tokens-per-s", type=float, default=100.0)
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--quiet-rate", type=float, default=1.0, help="req/s per quiet tenant")
    p.add_argument("--flood-factor", type=float, default=30.0)
    p.add_argument("--question-tokens", type=int, default=128)
    p.add_argument("--before", type=float, default=10.0, help="seconds before the flood")
    p.add_argument("--flood", type=float, default=30.0, help="seconds of flood")
    p.add_argument("--after", type=float, default=15.0, help="seconds after the flood")
    benchkit.add_subset(p, "--runs", RUNS, default="baseline,off,on")
    p.add_argument(
        "--workload",
        choices=("noisy_neighbour", "pressure"),
        default="noisy_neighbour",
        help="pressure: issue 15's many-tenant workload (one tenant to flow control) through "
        "runs off and on, to see what flow control costs a busy fleet without a flood",
    )
    p.add_argument("--conversations", type=int, default=240, help="pressure: conversations")
    p.add_argument("--concurrency", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=150.0, help="per request, seconds")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="also write every request (tenant, phase, replica, TTFT, gateway queue wait) as "
        "JSON lines",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.before, args.flood, args.after = 5.0, 10.0, 5.0
    trace: list[str] = []
    rows = asyncio.run(amain(args, trace))
    if args.trace:
        Path(args.trace).write_text("".join(trace))
    benchkit.write_json(args.json, rows)
    on = next((r for r in rows if r["run"] == "on"), None)
    return 1 if on is not None and (on["lost"] or on.get("other_errors")) else 0


if __name__ == "__main__":
    sys.exit(main())
