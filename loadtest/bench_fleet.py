"""Fleet mode benchmark: one gateway vs several gateways sharing Redis, same workload.

    python -m loadtest.bench_fleet                      # multi-tenant chat, 1 vs 3 gateways
    python -m loadtest.bench_fleet --workload trace     # Mooncake trace subset (token ids)
    python -m loadtest.bench_fleet --workload both --spread round_robin

Every run starts on fresh simulated replicas (one ``loadtest.replica`` process) whose KV pool
(``--num-gpu-blocks``) is smaller than the workload's working set, so where a prefix is placed
matters, and fresh gateway processes (``prefix-router serve``). Runs:

* ``1gw``        -- one gateway, no Redis (the single-gateway baseline);
* ``1gw+redis``  -- one gateway whose index lives in Redis (isolates the cost of the Redis
                    path from the cost of splitting the traffic);
* ``Ngw+redis``  -- ``--gateways`` gateways sharing one Redis; each request goes to a gateway
                    chosen per request (``--spread request``: at random; ``round_robin``: in
                    send order) or per conversation (``--spread conversation``). Per request is
                    the hard case: consecutive turns of one conversation usually reach
                    different gateways, so every turn depends on the shared index.

It prints, per run, the fleet hit rate (from the replicas' own counters), the ideal hit rate,
TTFT p50/p99, and from the gateways' ``/metrics``: the decision latency
(``prefix_router_decision_seconds``: index lookup + policy), Redis fallbacks (lookups answered
from the local view), decision reasons and predicted vs reported cached tokens. Then the added
latency of the Redis round trips, measured at concurrency 1 against instant replicas, with and
without ``--redis-url``. A redis-server is spawned for the run (``tests/redis_server.py``)
unless ``--redis-url`` names one (its keys under the bench's prefix are used; nothing else is
touched).

Target from issue 3: the N-gateway hit rate within 1 point of the single gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtest import benchkit, workloads
from loadtest import metrics_scrape as ms
from loadtest.metrics_scrape import parse_prometheus
from loadtest.procs import Proc, running, start_gateway, start_replicas, wait_ready
from loadtest.runner import GatewayTarget, RunResult, run_workload
from loadtest.workloads import RequestSpec, Workload
from router.schedule.registry import DEFAULT_POLICY

DECISION = "prefix_router_decision_seconds"
WORDS = [
    "account",
    "billing",
    "cluster",
    "deploy",
    "invoice",
    "latency",
    "migration",
    "quota",
    "refund",
    "region",
    "replica",
    "schema",
    "storage",
    "subscription",
    "ticket",
    "upgrade",
    "webhook",
    "workflow",
]
TARGET_POINTS = 1.0


# ---------------------------------------------------------------------------------------------
# a target spreading requests over several gateways


class MultiGatewayTarget(GatewayTarget):
    """Several gateways in front of the same replicas. ``spread``: ``request`` (a seeded
    random gateway per request), ``round_robin`` (per request, in send order) or
    ``conversation`` (a stable hash of the session: all turns of one conversation on one
    gateway). The replica that served a request is read from ``x-prefix-router-replica``."""

    kind = "gateway"

    def __init__(
        self,
        urls: list[str],
        replica_urls: list[str],
        *,
        spread: str = "request",
        seed: int = 0,
        name: str | None = None,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        if not urls:
            raise ValueError("need at least one gateway URL")
        if spread not in SPREADS:
            raise ValueError(f"spread must be one of {SPREADS}")
        super().__init__(urls[0], replica_urls, name=name, policy=policy)
        self.urls = [u.rstrip("/") for u in urls]
        self.spread = spread
        self._rng = random.Random(f"{seed}:gateways")
        self._next = 0

    def choose(self, spec: RequestSpec) -> str:
        if len(self.urls) == 1:
            return self.urls[0]
        if self.spread == "conversation":
            return self.urls[zlib.crc32(spec.session.encode()) % len(self.urls)]
        if self.spread == "round_robin":
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            return url
        return self._rng.choice(self.urls)

    def describe(self) -> str:
        return f"{len(self.urls)} gateways (policy {self.policy}, spread per {self.spread})"


SPREADS = ("request", "round_robin", "conversation")


# ---------------------------------------------------------------------------------------------
# the gateways' own metrics


@dataclass
class Histogram:
    """A Prometheus histogram summed over gateways: cumulative bucket counts, sum, count."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0

    def add(self, other: Histogram) -> None:
        for le, c in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + c
        self.total += other.total
        self.count += other.count

    def minus(self, other: Histogram) -> Histogram:
        return Histogram(
            {le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()},
            self.total - other.total,
            self.count - other.count,
        )

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Linear interpolation inside the bucket holding the q-th observation (as
        Prometheus' histogram_quantile)."""
        if not self.count:
            return math.nan
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                width = c - prev_c
                return prev_le + (le - prev_le) * ((rank - prev_c) / width if width else 1.0)
            prev_le, prev_c = le, c
        return prev_le


@dataclass
class GatewayStats:
    decision: Histogram = field(default_factory=Histogram)
    fallbacks: float = 0.0
    reasons: dict[str, float] = field(default_factory=dict)
    predicted_tokens: float = 0.0
    reported_tokens: float = 0.0
    redis_up: list[float] = field(default_factory=list)

    def add(self, other: GatewayStats) -> None:
        self.decision.add(other.decision)
        self.fallbacks += other.fallbacks
        for k, v in other.reasons.items():
            self.reasons[k] = self.reasons.get(k, 0.0) + v
        self.predicted_tokens += other.predicted_tokens
        self.reported_tokens += other.reported_tokens
        self.redis_up += other.redis_up

    def minus(self, other: GatewayStats) -> GatewayStats:
        return GatewayStats(
            self.decision.minus(other.decision),
            self.fallbacks - other.fallbacks,
            {k: v - other.reasons.get(k, 0.0) for k, v in self.reasons.items()},
            self.predicted_tokens - other.predicted_tokens,
            self.reported_tokens - other.reported_tokens,
            self.redis_up,
        )


def gateway_stats(text: str) -> GatewayStats:
    m = parse_prometheus(text)
    st = GatewayStats()
    for labels, v in m.get(DECISION + "_bucket", []):
        le = float(labels["le"])
        st.decision.buckets[le] = st.decision.buckets.get(le, 0.0) + v
    st.decision.total = sum(v for _, v in m.get(DECISION + "_sum", []))
    st.decision.count = sum(v for _, v in m.get(DECISION + "_count", []))
    st.fallbacks = sum(v for _, v in m.get("prefix_router_redis_fallbacks_total", []))
    for labels, v in m.get("prefix_router_decisions_total", []):
        st.reasons[labels.get("reason", "?")] = st.reasons.get(labels.get("reason", "?"), 0) + v
    st.predicted_tokens = sum(
        v for _, v in m.get("prefix_router_predicted_cached_tokens_total", [])
    )
    st.reported_tokens = sum(v for _, v in m.get("prefix_router_reported_cached_tokens_total", []))
    st.redis_up = [v for _, v in m.get("prefix_router_redis_up", [])]
    return st


async def scrape_gateways(urls: list[str]) -> GatewayStats:
    total = GatewayStats()
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                total.add(gateway_stats(await r.text()))
    return total


# ---------------------------------------------------------------------------------------------
# Redis


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """The given Redis URL, or a throwaway redis-server for the duration."""
    if url:
        yield url
        return
    try:
        from tests.redis_server import RedisServer
    except ImportError as e:  # run from a checkout: the repository root is on sys.path
        raise SystemExit(
            f"bench_fleet: cannot import tests.redis_server ({e}); run from the repository "
            "root or pass --redis-url"
        ) from None
    try:
        server = RedisServer()
    except FileNotFoundError as e:
        raise SystemExit(f"bench_fleet: {e}; install redis-server or pass --redis-url") from None
    with server:
        yield server.url


# ---------------------------------------------------------------------------------------------
# one run


@dataclass
class Run:
    label: str
    seed: int
    result: RunResult
    stats: GatewayStats

    @property
    def hit(self) -> float:
        return self.result.fleet_hit_rate or 0.0


def build_workload(a: argparse.Namespace, which: str, seed: int) -> Workload:
    if which == "trace":
        return workloads.trace(
            seed=seed,
            time_scale=a.time_scale,
            max_requests=a.trace_requests,
            max_input_tokens=a.trace_max_input_tokens,
            max_output_tokens=a.trace_max_output_tokens,
        )
    return workloads.multi_tenant(
        seed=seed,
        tenants=a.tenants,
        conversations=a.conversations,
        rate=a.rate,
        turns=(a.min_turns, a.max_turns),
        think_time_s=a.think_time,
        system_words=a.system_words,
        max_tokens=a.max_tokens,
    )


def gateway_flags(a: argparse.Namespace, redis_url: str | None, prefix: str) -> list[str]:
    flags = ["--policy", a.policy]
    if redis_url:
        flags += [
            "--redis-url",
            redis_url,
            "--redis-prefix",
            prefix,
            "--sync-interval-s",
            str(a.sync_interval_s),
            "--redis-timeout-ms",
            str(a.redis_timeout_ms),
            "--redis-layout",
            a.redis_layout,
            "--redis-flush-ms",
            str(a.redis_flush_ms),
        ]
    return flags


def gpu_blocks(a: argparse.Namespace, which: str) -> int:
    return a.trace_gpu_blocks if which == "trace" else a.num_gpu_blocks


def replica_flags(
    a: argparse.Namespace, blocks: int, seed: int, instant: bool = False
) -> list[str]:
    flags = ["--seed", str(seed), "--num-gpu-blocks", str(blocks)]
    if instant:
        return [*flags, "--instant"]
    return [
        *flags,
        "--prefill-tokens-per-s",
        str(a.prefill_tps),
        "--decode-tokens-per-s",
        str(a.decode_tps),
    ]


async def start_fleet(
    procs: list[Proc], replica_urls: list[str], n: int, flags: list[str]
) -> list[str]:
    gws = [start_gateway(replica_urls, *flags) for _ in range(n)]
    procs.extend(gws)
    await asyncio.gather(*(wait_ready(g.url) for g in gws))
    return [g.url for g in gws]


async def one_run(
    a: argparse.Namespace, which: str, label: str, n_gateways: int, redis_url: str | None, seed: int
) -> Run:
    prefix = f"bench-fleet-{which}-{label}-{seed}-{int(time.time() * 1000)}"
    with running() as procs:
        reps = start_replicas(a.replicas, *replica_flags(a, gpu_blocks(a, which), seed))
        procs.append(reps)
        urls = await start_fleet(procs, reps.urls, n_gateways, gateway_flags(a, redis_url, prefix))
        before = await scrape_gateways(urls)
        target = MultiGatewayTarget(urls, reps.urls, spread=a.spread, seed=seed, name=label)
        result = await run_workload(
            target,
            build_workload(a, which, seed),
            concurrency=a.concurrency,
            max_seconds=a.max_seconds,
            request_timeout_s=a.timeout,
            seed=seed,
            progress=not a.quiet,
            label=f"{which} {label} seed {seed}",
        )
        stats = (await scrape_gateways(urls)).minus(before)
    return Run(label, seed, result, stats)


@dataclass
class Row:
    """One configuration's figures, over one run or pooled over several (seeds)."""

    label: str
    runs: list[Run]

    @property
    def records(self) -> list[Any]:
        return [r for run in self.runs for r in run.result.records]

    @property
    def ok(self) -> int:
        return sum(run.result.ok for run in self.runs)

    @property
    def lost(self) -> int:
        return sum(run.result.lost for run in self.runs)

    @property
    def hit(self) -> float | None:
        return ms.fleet_hit_rate([d for run in self.runs for d in run.result.replica_deltas])

    @property
    def ideal(self) -> float | None:
        ideals = [run.result.ideal for run in self.runs if run.result.ideal is not None]
        q = sum(i.queries for i in ideals)
        return sum(i.hits for i in ideals) / q if q else None

    def ttft(self, q: float) -> float:
        xs = [r.ttft_s for r in self.records if r.ok and r.ttft_s is not None]
        return float(np.percentile(xs, q)) if xs else math.nan

    @property
    def stats(self) -> GatewayStats:
        total = GatewayStats()
        for run in self.runs:
            total.add(run.stats)
        return total

    @property
    def overpredicted(self) -> float | None:
        """Share of requests whose predicted cached tokens exceeded what the replica reported."""
        done = [r for r in self.records if r.ok and r.predicted_cached_blocks is not None]
        if not done:
            return None
        bs = self.runs[0].result.block_size
        over = sum(
            1 for r in done if (r.predicted_cached_blocks or 0) * bs > (r.cached_tokens or 0)
        )
        return over / len(done)


# ---------------------------------------------------------------------------------------------
# added latency of the Redis round trips


@dataclass
class Latency:
    label: str
    client_ms: list[float]
    decision: Histogram
    errors: int


async def latency_probe(a: argparse.Namespace, redis_url: str) -> list[Latency]:
    """Concurrency 1, instant replicas: client latency and decision latency of one gateway
    without and with Redis (same replicas, same request bodies)."""
    rng = random.Random(a.seed)
    tenants = [workloads.tenant_system_prompt(a.seed, t, a.system_words) for t in range(4)]
    words = WORDS
    bodies = [
        json.dumps(
            {
                "model": workloads.DEFAULT_MODEL,
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": tenants[i % len(tenants)]},
                    {"role": "user", "content": " ".join(rng.choices(words, k=30))},
                ],
            }
        ).encode()
        for i in range(64)
    ]
    out = []
    with running() as procs:
        reps = start_replicas(a.replicas, *replica_flags(a, a.num_gpu_blocks, a.seed, instant=True))
        procs.append(reps)
        for label, url in (("without Redis", None), ("with Redis", redis_url)):
            prefix = f"bench-fleet-latency-{int(time.time() * 1000)}"
            [gw] = await start_fleet(procs, reps.urls, 1, gateway_flags(a, url, prefix))
            lat: list[float] = []
            errors = 0
            async with aiohttp.ClientSession() as s:

                async def one(i: int, gw: str = gw) -> float:
                    nonlocal errors
                    t0 = time.perf_counter()
                    async with s.post(
                        gw + "/v1/chat/completions",
                        data=bodies[i % len(bodies)],
                        headers={"Content-Type": "application/json"},
                    ) as r:
                        await r.read()
                        errors += r.status != 200
                    return (time.perf_counter() - t0) * 1000

                for i in range(64):  # warm: connections, tokenizer caches, every prefix
                    await one(i)
                before = await scrape_gateways([gw])
                for i in range(a.latency_requests):
                    lat.append(await one(i))
                after = await scrape_gateways([gw])
            out.append(Latency(label, lat, after.decision.minus(before.decision), errors))
            procs.pop().stop()
    return out


# ---------------------------------------------------------------------------------------------
# report


def _pct(x: float | None) -> str:
    return benchkit.pct(x) if x is not None else "-"


def _ms(x: float) -> str:
    return benchkit.ms(x, digits=2) if x is not None and not math.isnan(x) else "-"


def print_rows(which: str, a: argparse.Namespace, rows: list[Row], title: str) -> None:
    table = benchkit.Text(
        [("run", 16), ("ok", 6), ("lost", 5), ("fleet hit", 10), ("ideal", 8), ("/ideal", 8)]
        + [("TTFT p50", 10), ("p99", 8), ("dec mean", 10), ("p50", 8), ("p99", 8)]
        + [("fallbk", 7), ("spill", 7), ("overpr", 7)]
    )
    print(f"\n{title}")
    print(table.head())
    for r in rows:
        st = r.stats
        decisions = sum(st.reasons.values()) or 1
        hit, ideal = r.hit, r.ideal
        ratio = hit / ideal if hit is not None and ideal else None
        cells = [r.label, r.ok, r.lost, _pct(hit), _pct(ideal), _pct(ratio)]
        cells += [_ms(r.ttft(50)), _ms(r.ttft(99)), _ms(st.decision.mean)]
        cells += [_ms(st.decision.quantile(0.5)), _ms(st.decision.quantile(0.99))]
        spill = _pct(st.reasons.get("spill", 0) / decisions)
        print(table.row([*cells, int(st.fallbacks), spill, _pct(r.overpredicted)]))


def report(which: str, a: argparse.Namespace, by_label: dict[str, list[Run]]) -> bool:
    """Print per-seed and pooled tables; True when the hit-rate target is met (pooled)."""
    first = next(iter(by_label.values()))[0].result
    print(f"\n== {which}: {first.workload_description}")
    print(
        f"   {a.replicas} replicas x {gpu_blocks(a, which)} KV blocks, "
        f"concurrency {a.concurrency}, spread per {a.spread}, "
        f"sync interval {a.sync_interval_s}s, Redis lookup timeout {a.redis_timeout_ms:g} ms, "
        f"seeds {a.seed}..{a.seed + a.repeat - 1}"
    )
    labels = list(by_label)
    if a.repeat > 1:
        per_seed = [
            Row(f"{label} s{run.seed}", [run]) for label in labels for run in by_label[label]
        ]
        print_rows(which, a, per_seed, "per seed:")
    pooled = [Row(label, by_label[label]) for label in labels]
    print_rows(which, a, pooled, "pooled over seeds:" if a.repeat > 1 else "")
    print(
        "   times in ms; 'dec' = gateway decision latency (index lookup + policy, "
        "prefix_router_decision_seconds, all gateways; p50/p99 interpolated in its buckets); "
        "'fallbk' = Redis lookups answered from the local view; 'spill' = decisions sent away "
        "from the longest cached prefix (load bound); 'overpr' = requests whose predicted "
        "cached tokens exceeded what the replica reported"
    )
    base = pooled[0]
    met = True
    for r in pooled[1:]:
        gap = 100 * ((base.hit or 0) - (r.hit or 0))
        gaps = [
            100 * (b.hit - x.hit)
            for b, x in zip(by_label[base.label], by_label[r.label], strict=True)
        ]
        verdict = "within" if gap <= TARGET_POINTS else "MISSES"
        met = met and (gap <= TARGET_POINTS or r.label == "1gw+redis")
        spread = f" (per seed {min(gaps):+.2f}..{max(gaps):+.2f})" if len(gaps) > 1 else ""
        print(
            f"   hit-rate gap {base.label} - {r.label}: {gap:+.2f} points{spread}: "
            f"{verdict} the {TARGET_POINTS:g}-point target"
        )
    for label in labels:
        for run in by_label[label]:
            res = run.result
            if res.lost or res.errors_by_status:
                print(f"   {label} s{run.seed}: errors {res.errors_by_status}, lost {res.lost}")
    for w in sorted({w for runs in by_label.values() for run in runs for w in run.result.warnings}):
        print(f"   warning: {w}")
    return met


def print_latency(lat: list[Latency], n: int) -> None:
    print(
        f"\n== added latency of the Redis round trips: concurrency 1, {n} requests, instant "
        "replicas"
    )
    table = benchkit.Text(
        [("gateway", 14), ("client p50", 11), ("p99", 8), ("decision mean", 14), ("p50", 8)]
        + [("p99", 8), ("errors", 7)]
    )
    print(table.head())
    for x in lat:
        c = np.asarray(x.client_ms) if x.client_ms else np.asarray([math.nan])
        cells = [x.label, f"{np.percentile(c, 50):.2f}", f"{np.percentile(c, 99):.2f}"]
        cells += [_ms(x.decision.mean), _ms(x.decision.quantile(0.5))]
        print(table.row([*cells, _ms(x.decision.quantile(0.99)), x.errors]))
    if len(lat) == 2 and lat[0].client_ms and lat[1].client_ms:
        d50 = np.percentile(lat[1].client_ms, 50) - np.percentile(lat[0].client_ms, 50)
        dec = 1000 * (lat[1].decision.mean - lat[0].decision.mean)
        print(f"   Redis adds {d50:+.2f} ms at p50 end to end; {dec:+.3f} ms per decision (mean)")
    print("   (decision p50/p99 are interpolated inside the histogram's buckets)")


# ---------------------------------------------------------------------------------------------


async def run(a: argparse.Namespace) -> int:
    which_list = ["multi_tenant", "trace"] if a.workload == "both" else [a.workload]
    lost = 0
    met = True
    with redis_server(a.redis_url) as url:
        for which in which_list:
            plan: list[tuple[str, int, str | None]] = [("1gw", 1, None)]
            if not a.skip_single_redis:
                plan.append(("1gw+redis", 1, url))
            plan.append((f"{a.gateways}gw+redis", a.gateways, url))
            by_label: dict[str, list[Run]] = {label: [] for label, _, _ in plan}
            for i in range(a.repeat):
                seed = a.seed + i
                for label, n, r_url in plan:
                    print(f"running {which} {label} seed {seed} ...", file=sys.stderr, flush=True)
                    run_ = await one_run(a, which, label, n, r_url, seed)
                    by_label[label].append(run_)
                    lost += run_.result.lost
            met = report(which, a, by_label) and met
        if a.latency_requests > 0:
            print("running the latency probe ...", file=sys.stderr, flush=True)
            print_latency(await latency_probe(a, url), a.latency_requests)
    if lost:
        return 1
    return 1 if a.strict and not met else 0


def build_parser() -> argparse.ArgumentParser:
    p = benchkit.parser(
        "loadtest.bench_fleet",
        __doc__,
        seed=0,
        seed_help="first seed (workload and replicas)",
        whole_doc=True,
    )
    p.add_argument("--workload", choices=("multi_tenant", "trace", "both"), default="multi_tenant")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--spread", choices=SPREADS, default="request")
    p.add_argument("--policy", default=DEFAULT_POLICY, help="gateway policy")
    p.add_argument("--redis-url", help="use this Redis instead of spawning redis-server")
    p.add_argument("--sync-interval-s", type=float, default=0.5, help="gateway sync interval")
    p.add_argument("--redis-timeout-ms", type=float, default=10.0, help="Redis lookup timeout")
    p.add_argument(
        "--redis-layout", choices=("map", "zsets"), default="map", help="the index's Redis layout"
    )
    p.add_argument("--redis-flush-ms", type=float, default=100.0, help="the map layout's flush")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=1024,
        help="KV blocks per simulated replica (multi_tenant, latency probe)",
    )
    p.add_argument("--prefill-tps", type=float, default=50_000.0, help="simulated prefill tok/s")
    p.add_argument("--decode-tps", type=float, default=200.0, help="simulated decode tok/s")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=60.0, help="per request")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per configuration, seeds --seed, --seed+1, ...; figures are also pooled "
        "(one run's hit rate moves by about a point from timing alone)",
    )
    g = p.add_argument_group("multi_tenant")
    g.add_argument("--tenants", type=int, default=6)
    g.add_argument("--conversations", type=int, default=60)
    g.add_argument("--rate", type=float, default=3.0, help="conversations per second")
    g.add_argument("--min-turns", type=int, default=3)
    g.add_argument("--max-turns", type=int, default=8)
    g.add_argument("--think-time", type=float, default=0.5)
    g.add_argument("--system-words", type=int, default=800)
    g.add_argument("--max-tokens", type=int, default=48)
    g = p.add_argument_group("trace")
    g.add_argument("--trace-requests", type=int, default=300)
    g.add_argument(
        "--trace-gpu-blocks", type=int, default=8192, help="KV blocks per replica (trace)"
    )
    g.add_argument("--time-scale", type=float, default=4.0)
    g.add_argument("--trace-max-input-tokens", type=int, default=16_000)
    g.add_argument("--trace-max-output-tokens", type=int, default=32)
    p.add_argument(
        "--latency-requests", type=int, default=300, help="latency probe requests (0: skip)"
    )
    p.add_argument(
        "--skip-single-redis", action="store_true", help="skip the 1-gateway-with-Redis run"
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when the hit-rate target is missed"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.gateways < 1 or a.replicas < 1 or a.repeat < 1:
        raise SystemExit("bench_fleet: --gateways, --replicas and --repeat must be at least 1")
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
