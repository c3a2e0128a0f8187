"""Prefill/decode disaggregation benchmark: the same workload on the same simulated fleet,
aggregated and disaggregated, side by side in one run.

    python -m loadtest.bench_pd                         # multi-tenant chats, 2 prefill + 2 decode
    python -m loadtest.bench_pd --workload agentic      # long closed-loop agent sessions
    python -m loadtest.bench_pd --runs aggregated,vllm_router_pd

Every run starts fresh simulated replicas (one ``loadtest.replica`` process serving both legs
of vLLM 0.34's NixlConnector in pull mode, ``--kv-connector NixlConnector``) and a fresh
router in front of them. Runs:

* ``aggregated``        -- ``prefix-router serve`` (its default policy) over all replicas, no
                           disaggregation: the baseline every ratio is against;
* ``pd_round_robin``    -- the gateway's P/D, round robin on both pools, every request split;
* ``pd_prefix_least_loaded`` -- prefix-aware prefill pool, least-loaded decode, always split;
* ``pd_prefix_affinity``     -- prefix-aware on both pools (decode affinity), always split;
* ``pd_prefix_affinity_skip`` -- the same with the gateway's defaults: no prefill leg for a
                           short prompt or one the decode replica mostly holds;
* ``pd_prefill_first``  -- the same, the decode replica chosen again after the prefill answer;
* ``vllm_router_rr_pd`` -- vllm-router ``--vllm-pd-disaggregation`` with round robin on both
                           pools (half the replicas prefill, half decode);
* ``vllm_router_pd``    -- vllm-router P/D with ``--prefill-policy cache_aware
                           --decode-policy power_of_two`` (as its docs suggest).

vllm-router runs need ``pip install vllm-router`` (skipped, and said so, when absent).

Per run: requests ok / failed, the prefill pool's hit rate (the prefill replicas' own
``vllm:prefix_cache_*`` counters; for ``aggregated`` the whole fleet's) against its ideal hit
rate (one unlimited cache over the prompts that had a prefill leg, answers not cached: the
prefill replica never generates them; for ``aggregated`` the usual ideal), KV blocks the decode pool pulled per request
(``vllm:external_prefix_cache_hits`` / block size), for the gateway's runs the blocks pulled
against the fewest any decode replica lacked at decision time (its ``prefix_router_pd_*``
counters) and the share of requests with a prefill leg, the decode pool's local hits, and TTFT
p50/p99 with its ratio to ``aggregated`` and to ``vllm_router_pd``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtest import benchkit, workloads
from loadtest.ideal import IdealRequest, ideal_hit_rate
from loadtest.metrics_scrape import parse_prometheus
from loadtest.procs import (
    Proc,
    free_port,
    running,
    start,
    start_gateway,
    start_replicas,
    wait_ready,
)
from loadtest.runner import (
    GatewayTarget,
    RequestRecord,
    RunResult,
    default_renderer,
    run_workload,
)

RUNS = (
    "aggregated",
    "pd_round_robin",
    "pd_prefix_least_loaded",
    "pd_prefix_affinity",
    "pd_prefix_affinity_skip",
    "pd_prefill_first",
    "vllm_router_rr_pd",
    "vllm_router_pd",
)
# The gateway's P/D modes: its flags beside --prefill-replica / --decode-replica.
ALWAYS_SPLIT = ("--pd-min-prompt-tokens", "0", "--pd-min-uncached-tokens", "0")
GATEWAY_PD: dict[str, tuple[str, ...]] = {
    "pd_round_robin": (
        "--pd-prefill-policy",
        "round_robin",
        "--pd-decode-policy",
        "round_robin",
        *ALWAYS_SPLIT,
    ),
    "pd_prefix_least_loaded": ("--pd-decode-policy", "least_loaded", *ALWAYS_SPLIT),
    "pd_prefix_affinity": ALWAYS_SPLIT,
    "pd_prefix_affinity_skip": (),  # the gateway's defaults
    "pd_prefill_first": ("--pd-order", "prefill-first"),
}
BLOCK_SIZE = 16


@dataclass
class Row:
    run: str
    ok: int
    failed: int
    prefill_hit: float | None
    ideal_hit: float | None
    pulled_per_request: float | None
    decode_local_hit: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    pulled_vs_fewest: float | None = None  # the gateway's decode choice against the minimum
    split_share: float | None = None  # requests that had a prefill leg


async def _counters(urls: list[str]) -> dict[str, dict[str, float]]:
    import aiohttp

    names = (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
    )
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.get(url + "/metrics") as r:
                families = parse_prometheus(await r.text())
            out[url] = {n: sum(v for _, v in families.get(n, [])) for n in names}
    return out


def _sum(counts: dict[str, dict[str, float]], urls: list[str], name: str) -> float:
    return sum(counts[u][name] for u in urls)


def _router(run: str, prefill: list[str], decode: list[str]) -> Proc | None:
    if shutil.which("vllm-router") is None:
        return None
    policies = (
        ("round_robin", "round_robin")
        if run == "vllm_router_rr_pd"
        else (
            "cache_aware",
            "power_of_two",
        )
    )
    port = free_port()
    cmd = [
        "vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",  # its own metrics on a free port (29000 may be taken)
        str(free_port()),
        "--vllm-pd-disaggregation",
        *[x for u in prefill for x in ("--prefill", u)],
        *[x for u in decode for x in ("--decode", u)],
        "--prefill-policy",
        policies[0],
        "--decode-policy",
        policies[1],
    ]
    return start(run, cmd, [f"http://127.0.0.1:{port}"])


async def one_run(run: str, a: argparse.Namespace, workload_kw: dict[str, Any]) -> Row | None:
    n = a.prefill + a.decode
    sim_flags = [
        "--kv-connector",
        "NixlConnector",
        "--prefill-tokens-per-s",
        str(a.prefill_tps),
        "--decode-tokens-per-s",
        str(a.decode_tps),
        "--decode-cost-tokens",
        str(a.decode_cost),
        "--num-gpu-blocks",
        str(a.gpu_blocks),
    ]
    with running() as procs:
        replicas = start_replicas(n, *sim_flags)
        procs.append(replicas)
        urls = replicas.urls
        prefill, decode = urls[: a.prefill], urls[a.prefill :]
        if run == "aggregated":
            router = start_gateway(urls)
            ready = "/ready"
        elif run in GATEWAY_PD:
            roles = [*(x for u in prefill for x in ("--prefill-replica", u))]
            roles += [x for u in decode for x in ("--decode-replica", u)]
            router = start_gateway([], *roles, *GATEWAY_PD[run])
            ready = "/ready"
        else:
            maybe = _router(run, prefill, decode)
            if maybe is None:
                benchkit.progress(f"{run}: vllm-router not installed (pip install vllm-router)")
                return None
            router, ready = maybe, "/health"
        procs.append(router)
        await wait_ready(router.url, ready, proc=router)
        workload = workloads.build(a.workload, **workload_kw)
        before = await _counters(urls)
        res: RunResult = await run_workload(
            GatewayTarget(router.url, urls),
            workload,
            concurrency=a.concurrency,
            max_seconds=a.seconds,
            request_timeout_s=120,
            progress=False,
            label=run,
        )
        after = await _counters(urls)
        gw = await _gateway_counters(router.url) if run in GATEWAY_PD else {}
    delta = {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in urls}
    pool = urls if run == "aggregated" else prefill
    queries = _sum(delta, pool, "vllm:prefix_cache_queries_total")
    hits = _sum(delta, pool, "vllm:prefix_cache_hits_total")
    pulled = _sum(delta, decode, "vllm:external_prefix_cache_hits_total")
    d_queries = _sum(delta, decode, "vllm:prefix_cache_queries_total")
    d_hits = _sum(delta, decode, "vllm:prefix_cache_hits_total")
    ttft = res.ttft
    if run == "aggregated":
        ideal = res.ideal.hit_rate if res.ideal is not None else None
    elif run in GATEWAY_PD:  # the requests the gateway gave a prefill leg
        ideal = prefill_ideal(res, lambda r: r.prefill_replica is not None)
    else:  # vllm-router sends every request to a prefill replica
        ideal = prefill_ideal(res, lambda r: True)
    return Row(
        run,
        res.ok,
        res.sent - res.ok,
        hits / queries if queries else None,
        ideal,
        None if run == "aggregated" else pulled / BLOCK_SIZE / max(1, res.ok),
        None if run == "aggregated" or not d_queries else d_hits / d_queries,
        ttft.get("p50"),
        ttft.get("p99"),
        _ratio(gw.get("prefix_router_pd_pulled_blocks_total"), gw.get(FEWEST)),
        gw.get("prefix_router_pd_legs_total", 0.0) / 2 / max(1, res.ok) if gw else None,
    )


FEWEST = "prefix_router_pd_fewest_pulled_blocks_total"


def prefill_ideal(res: RunResult, had_prefill: Callable[[RequestRecord], bool]) -> float | None:
    """The prefill pool's ideal hit rate: one unlimited cache over the prompts that had a
    prefill leg, in send order. A prefill replica never sees an answer (it generates one
    token), so none is cached at completion: a later turn's prompt brings it."""
    renderer = default_renderer()
    reqs = []
    for r in res.records:
        if r.ok and r.spec is not None and had_prefill(r):
            salt = r.spec.make_body().get("cache_salt") if r.spec.body is not None else None
            ids = r.spec.prompt_token_ids(renderer)
            reqs.append(IdealRequest(r.sent_s or 0.0, ids, r.end_s, [], salt))
    return ideal_hit_rate(reqs, BLOCK_SIZE).hit_rate if reqs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def _gateway_counters(url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        families = parse_prometheus(await r.text())
    names = ("prefix_router_pd_pulled_blocks_total", FEWEST, "prefix_router_pd_legs_total")
    return {n: sum(v for _, v in families.get(n, [])) for n in names}


def table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.run == "aggregated"), None)
    peer = next((r for r in rows if r.run == "vllm_router_pd"), None)
    return benchkit.markdown(
        "run | ok | failed | prefill pool hit | ideal | hit/ideal | blocks pulled/request | "
        "pulled/fewest | split | decode local hit | TTFT p50 ms | p99 ms | p99 x aggregated | "
        "p99 x vllm-router",
        [
            (
                r.run,
                r.ok,
                r.failed,
                benchkit.pct(r.prefill_hit),
                benchkit.pct(r.ideal_hit),
                benchkit.ratio(r.prefill_hit, r.ideal_hit),
                "-" if r.pulled_per_request is None else f"{r.pulled_per_request:.1f}",
                "-" if r.pulled_vs_fewest is None else f"{r.pulled_vs_fewest:.2f}",
                benchkit.pct(r.split_share),
                benchkit.pct(r.decode_local_hit),
                benchkit.ms(r.ttft_p50),
                benchkit.ms(r.ttft_p99),
                benchkit.ratio(r.ttft_p99, base.ttft_p99 if base else None, 2),
                benchkit.ratio(r.ttft_p99, peer.ttft_p99 if peer else None, 2),
            )
            for r in rows
        ],
    )


async def run(a: argparse.Namespace) -> int:
    names = benchkit.subset(a.runs, RUNS, "run")
    kw: dict[str, Any] = {"seed": a.seed}
    if a.workload == "multi_tenant":
        kw.update(tenants=6, conversations=24 if a.quick else 60, rate=4.0, turns=(3, 6))
        kw.update(think_time_s=0.5, system_words=1200, max_tokens=64)
    else:
        kw.update(sessions=6 if a.quick else 16, rate=1.0, turns=(4, 10), time_scale=4.0)
    rows = []
    for name in names:
        benchkit.progress(f"{name}: {a.workload}, {a.prefill} prefill + {a.decode} decode")
        row = await one_run(name, a, kw)
        if row is not None:
            rows.append(row)
    print(table(rows))
    benchkit.write_json(a.json, [r.__dict__ for r in rows])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser(
        "loadtest.bench_pd",
        __doc__,
        seed=0,
        seed_help="seed of the workload",
        seconds=(120.0, "at most this long per run"),
        quick="fewer conversations or sessions",
        json=True,
    )
    p.add_argument("--workload", choices=("multi_tenant", "agentic"), default="multi_tenant")
    benchkit.add_subset(p, "--runs", RUNS)
    p.add_argument("--prefill", type=int, default=2, help="prefill replicas (P/D runs)")
    p.add_argument("--decode", type=int, default=2, help="decode replicas (P/D runs)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--prefill-tps", type=float, default=40_000.0, help="replica prefill tokens/s")
    p.add_argument("--decode-tps", type=float, default=50.0, help="decode tokens/s per sequence")
    p.add_argument(
        "--decode-cost", type=float, default=4.0, help="prefill tokens one decode token costs"
    )
    p.add_argument("--gpu-blocks", type=int, default=8192, help="KV blocks per replica")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
