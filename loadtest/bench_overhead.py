"""The gateway's own cost, side by side with sending straight to a replica, in one run.

    python -m loadtest.bench_overhead [--requests 400] [--concurrency 64] [--peers]

Backends are instant fakes (``loadtest.fake_backend``) in their own process, so only routing
cost shows. Chat requests carry ~``--prompt-tokens`` tokens of which ``--shared-tokens`` are a
system prompt common to all requests (``--cold``: nothing repeats; ``--fresh-user-turn``: the
system prompt repeats and the user turn is new on every request, the common case; without
either, 64 distinct bodies repeat). ``--lazy-ab`` also runs the gateway with
``--no-lazy-tail`` in the same run; ``--workers N --redis`` runs the N workers (one port,
SO_REUSEPORT) on a throwaway redis-server, sharing one index. Prints, per target: latency
p50/p99 at concurrency 1 and the added latency over direct; throughput at ``--concurrency``
and its ratio to direct; the gateway's CPU per request and resident memory. Every run also
measures the Python floor (``loadtest.passthrough``: aiohttp in, the gateway's client out,
no routing), so the table shows what the HTTP path costs before any routing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtest import benchkit
from loadtest.bench_fleet import redis_server
from loadtest.procs import Proc, free_port, running, start, start_gateway, wait_ready
from router.schedule.registry import DEFAULT_POLICY

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "policy",
    "customer",
    "account",
    "invoice",
    "refund",
    "shipping",
    "warranty",
    "ticket",
    "escalate",
]


FLOOR = "python floor, no routing"


def text_of_tokens(n_tokens: int, rng: random.Random) -> str:
    # These words are one token each (with their leading space) in Qwen3's vocabulary, give or
    # take punctuation: close enough for a ~N-token prompt.
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


def make_bodies(
    n: int,
    prompt_tokens: int,
    shared_tokens: int,
    cold: bool,
    seed: int,
    stream: bool,
    fresh_user: bool = False,
) -> list[bytes]:
    rng = random.Random(seed)
    shared = text_of_tokens(shared_tokens, rng)
    out = []
    for i in range(n):
        system = f"Request {i}. " + text_of_tokens(shared_tokens, rng) if cold else shared
        user = text_of_tokens(max(1, prompt_tokens - shared_tokens), rng)
        if fresh_user:  # distinct from the first word on: no segment or block repeats
            user = f"Question {i}: {user}"
        out.append(
            json.dumps(
                {
                    "model": "Qwen/Qwen3-0.6B",
                    "max_tokens": 1,
                    "stream": stream,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": user},
                    ],
                }
            ).encode()
        )
    return out


@dataclass
class Result:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    throughput_rps: float = 0.0
    errors: int = 0
    cpu_ms_per_request: float | None = None
    rss_mb: float | None = None

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


async def measure(
    name: str,
    urls: list[str],
    bodies: list[bytes],
    n_latency: int,
    n_throughput: int,
    concurrency: int,
    proc: Proc | None,
) -> Result:
    res = Result(name)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as s:

        async def one(i: int) -> float:
            url = urls[i % len(urls)] + "/v1/chat/completions"
            t0 = time.perf_counter()
            async with s.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    res.errors += 1
            return (time.perf_counter() - t0) * 1000

        for i in range(min(50, n_latency)):  # warm connections, caches, the JIT-less rest
            await one(i)
        for i in range(n_latency):
            res.latencies_ms.append(await one(i))

        cpu0 = proc.cpu_seconds() if proc else 0.0
        counter = iter(range(n_throughput))
        t0 = time.perf_counter()

        async def worker() -> None:
            for i in counter:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        res.throughput_rps = n_throughput / elapsed
        if proc:
            res.cpu_ms_per_request = (proc.cpu_seconds() - cpu0) * 1000 / n_throughput
            res.rss_mb = proc.rss_mb()
    return res


async def measure_pair(
    names: tuple[str, str],
    urls: tuple[str, str],
    procs: tuple[Proc, Proc],
    bodies: list[bytes],
    n_latency: int,
    n_throughput: int,
    concurrency: int,
    rounds: int = 4,
) -> list[Result]:
    """Two gateways measured interleaved, so the shared machine's drift hits both alike:
    at concurrency 1 requests alternate between them; the concurrency phase alternates in
    ``rounds`` slices each. Every body goes to one of them only (none is cached twice)."""
    res = [Result(names[0]), Result(names[1])]
    headers = {"Content-Type": "application/json"}
    cpu = [0.0, 0.0]
    busy = [0.0, 0.0]
    done = [0, 0]
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=2 * concurrency + 4)
    ) as s:
        next_body = iter(range(10**9))

        async def one(k: int) -> float:
            i = next(next_body)
            t0 = time.perf_counter()
            url = urls[k] + "/v1/chat/completions"
            async with s.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    res[k].errors += 1
            return (time.perf_counter() - t0) * 1000

        for i in range(min(50, n_latency)):
            await one(i % 2)
        for i in range(2 * n_latency):
            res[i % 2].latencies_ms.append(await one(i % 2))
        per = max(1, n_throughput // rounds)
        for r in range(2 * rounds):
            k = r % 2
            c0 = procs[k].cpu_seconds()
            counter = iter(range(per))
            t0 = time.perf_counter()

            async def worker(k: int = k, counter: Any = counter) -> None:
                for _ in counter:
                    await one(k)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            busy[k] += time.perf_counter() - t0
            cpu[k] += procs[k].cpu_seconds() - c0
            done[k] += per
    for k in (0, 1):
        res[k].throughput_rps = done[k] / busy[k]
        res[k].cpu_ms_per_request = cpu[k] * 1000 / done[k]
        res[k].rss_mb = procs[k].rss_mb()
    return res


async def memory_phase(gw: Proc, n: int, concurrency: int) -> list[tuple[int, float, float]]:
    """Send ``n`` distinct 256-token token-id prompts; sample RSS and index size on the way."""
    rng = random.Random(1)
    out = []
    checkpoints = {n // 4, n // 2, 3 * n // 4, n}
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            for i in counter:
                ids = [rng.randrange(1000, 100000) for _ in range(256)]
                body = json.dumps({"model": "Qwen/Qwen3-0.6B", "prompt": ids, "max_tokens": 1})
                async with s.post(
                    gw.url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as r:
                    await r.read()
                if i + 1 in checkpoints:
                    async with s.get(gw.url + "/metrics") as r:
                        text = await r.text()
                    blocks = sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in text.splitlines()
                        if line.startswith("prefix_router_index_blocks{")
                    )
                    out.append((i + 1, gw.rss_mb(), blocks))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(out)


def peer_commands(backends: list[str], port: int) -> dict[str, list[str]]:
    """Rust peers, when installed (``pip install vllm-router sglang-router``)."""
    out = {}
    if shutil.which("vllm-router"):
        out["vllm-router cache_aware"] = [
            "vllm-router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "cache_aware",
            "--worker-urls",
            *backends,
        ]
    if shutil.which("smg"):
        out["smg cache_aware"] = [
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port + 1),
            "--policy",
            "cache_aware",
            "--worker-urls",
            *backends,
        ]
    return out


async def run(a: argparse.Namespace) -> int:
    ports = [free_port() for _ in range(a.backends)]
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    bodies = make_bodies(
        max(a.requests, 64) if a.cold else 64,
        a.prompt_tokens,
        a.shared_tokens,
        a.cold,
        a.seed,
        a.stream,
    )
    if a.cold or a.fresh_user_turn:
        bodies = make_bodies(
            2 * a.requests + a.throughput_requests + 100,
            a.prompt_tokens,
            a.shared_tokens,
            a.cold,
            a.seed,
            a.stream,
            fresh_user=a.fresh_user_turn,
        )
    results: list[Result] = []
    memory: list[tuple[int, float, float]] = []
    with running() as procs, contextlib.ExitStack() as stack:
        cmd = [sys.executable, "-m", "loadtest.fake_backend", "--ports", ",".join(map(str, ports))]
        procs.append(start("backends", cmd, backends))
        for b in backends:
            await wait_ready(b, "/health")
        shape = _shape(a)
        print(
            f"{a.backends} instant backends up; {len(bodies)} distinct bodies of "
            f"~{a.prompt_tokens} tokens ({shape})",
            file=sys.stderr,
        )
        n = (a.requests, a.throughput_requests, a.concurrency)
        results.append(await measure("direct", backends, bodies, *n, None))

        if a.lazy_ab:  # the lazy tail on and off, interleaved, in front of the same backends
            pair = []
            for extra in ((), ("--no-lazy-tail",)):
                gw = start_gateway(backends, "--policy", a.policy, *extra)
                procs.append(gw)
                await wait_ready(gw.url, "/ready")
                pair.append(gw)
            names = (f"prefix-router {a.policy}", f"prefix-router {a.policy} no-lazy")
            results += await measure_pair(
                names, (pair[0].url, pair[1].url), (pair[0], pair[1]), bodies, *n
            )
            for gw in pair:
                gw.stop()
        runs = [] if a.lazy_ab else [(w, True) for w in sorted({1, a.workers})]
        redis = stack.enter_context(redis_server(None)) if a.redis and a.workers > 1 else None
        for workers, lazy in runs:
            extra: tuple[str, ...] = () if lazy else ("--no-lazy-tail",)
            if redis is not None and workers > 1:  # the workers share one index and load view
                extra += ("--redis-url", redis)
            gw = start_gateway(backends, "--policy", a.policy, "--workers", str(workers), *extra)
            procs.append(gw)
            await wait_ready(gw.url, "/ready")
            name = f"prefix-router {a.policy}" + (f" x{workers}" if workers > 1 else "")
            name += " redis" if redis is not None and workers > 1 else ""
            name += "" if lazy else " no-lazy"
            # With workers, CPU and memory are the parent's only: see the note in the table.
            results.append(await measure(name, [gw.url], bodies, *n, gw if workers == 1 else None))
            if workers == 1 and lazy and a.memory_prefixes:
                memory = await memory_phase(gw, a.memory_prefixes, a.concurrency)
            gw.stop()

        # The Python HTTP path alone (aiohttp in, the gateway's client out, no routing): what
        # is left of the gateway's cost once routing is free.
        port = free_port()
        fcmd = [sys.executable, "-m", "loadtest.passthrough", "--port", str(port)]
        fcmd += [x for b in backends for x in ("--replica", b)]
        floor = start("python floor", fcmd, [f"http://127.0.0.1:{port}"])
        procs.append(floor)
        await wait_ready(floor.url, "/health")
        results.append(await measure(FLOOR, [floor.url], bodies, *n, floor))
        floor.stop()

        if a.peers:
            for name, pcmd in peer_commands(backends, free_port()).items():
                port = pcmd[pcmd.index("--port") + 1]
                env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
                peer = start(name, pcmd, [f"http://127.0.0.1:{port}"], env=env)
                procs.append(peer)
                try:
                    await wait_ready(peer.url, "/health", timeout=30)
                except RuntimeError as e:
                    print(f"skipping {name}: {e}", file=sys.stderr)
                    continue
                results.append(await measure(name, [peer.url], bodies, *n, peer))
                peer.stop()  # the peers share default side ports (metrics): one at a time
    print_table(results, a)
    for sent, rss, blocks in memory:
        print(
            f"after {sent:>7,} distinct prefixes: gateway RSS {rss:6.0f} MB, index "
            f"{blocks:,.0f} blocks"
        )
    if memory:
        print(
            "(the index is bounded by the replicas' capacity in blocks: RSS plateaus once it "
            "is full, whatever the traffic)"
        )
    return 0


def print_table(results: list[Result], a: argparse.Namespace) -> None:
    direct = results[0]
    print(
        f"\nconcurrency 1: {a.requests} requests; concurrency {a.concurrency}: "
        f"{a.throughput_requests} requests; ~{a.prompt_tokens}-token chat prompts "
        f"({_shape(a)}), stream={a.stream}"
    )
    table = benchkit.Text(
        [("target", 28), ("p50 ms", 9), ("p99 ms", 9), ("+p50", 8), ("+p99", 8), ("req/s", 9)]
        + [("x direct", 9), ("cpu ms/req", 11), ("rss MB", 8), ("errors", 7)]
    )
    print(table.head())
    for r in results:
        add50 = r.p(50) - direct.p(50)
        add99 = r.p(99) - direct.p(99)
        cpu = f"{r.cpu_ms_per_request:.3f}" if r.cpu_ms_per_request is not None else "-"
        rss = f"{r.rss_mb:.0f}" if r.rss_mb is not None else "-"
        cells = [r.name, f"{r.p(50):.3f}", f"{r.p(99):.3f}", f"{add50:+.3f}", f"{add99:+.3f}"]
        x_direct = benchkit.ratio(r.throughput_rps, direct.throughput_rps, digits=2)
        print(table.row([*cells, f"{r.throughput_rps:.0f}", x_direct, cpu, rss, r.errors]))
    if a.cold:
        ours = next(r for r in results if r.name.startswith("prefix-router"))
        per_k = (ours.p(50) - direct.p(50)) / (a.prompt_tokens / 1000)
        print(f"cold prompts: the gateway adds {per_k:.3f} ms per 1,000 prompt tokens (p50)")
    ours = [r for r in results if r.name.startswith("prefix-router")]
    for peer in results:
        if peer.name == "direct" or peer in ours:
            continue
        ratios = ", ".join(f"{o.name}: {o.throughput_rps / peer.throughput_rps:.2f}x" for o in ours)
        print(f"throughput vs {peer.name}: {ratios}")


def _shape(a: argparse.Namespace) -> str:
    if a.cold:
        return "cold"
    if a.fresh_user_turn:
        return f"{a.shared_tokens} shared, a new user turn every request"
    return f"{a.shared_tokens} shared"


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser("loadtest.bench_overhead", __doc__, seed=0, whole_doc=True)
    p.add_argument("--requests", type=int, default=400, help="requests at concurrency 1")
    p.add_argument("--throughput-requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--shared-tokens", type=int, default=3000)
    p.add_argument("--cold", action="store_true", help="every prompt distinct (no reuse)")
    p.add_argument(
        "--fresh-user-turn",
        action="store_true",
        help="the system prompt repeats, the user turn is new on every request",
    )
    p.add_argument(
        "--lazy-ab",
        action="store_true",
        help="run the gateway with and without --no-lazy-tail (the whole prompt tokenized "
        "first), interleaved, instead of the --workers runs",
    )
    p.add_argument("--stream", action="store_true", help="streaming requests")
    p.add_argument("--policy", default=DEFAULT_POLICY)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also run the gateway with this many worker processes (--workers)",
    )
    p.add_argument(
        "--redis",
        action="store_true",
        help="the --workers run shares one throwaway redis-server (fleet mode), as workers "
        "should be deployed: one prefix index and load view for all of them",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run vllm-router and smg when installed (pip install vllm-router sglang-router)",
    )
    p.add_argument(
        "--memory-prefixes",
        type=int,
        default=0,
        metavar="N",
        help="then send N distinct 256-token prompts and report the gateway's RSS "
        "and index size (e.g. 100000)",
    )
    a = p.parse_args(argv)
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
