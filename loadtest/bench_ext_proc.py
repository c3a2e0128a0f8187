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
tokens behind a shared system prompt, the four paths interleaved request by request: straight
to a backend (``direct``), through the gateway's HTTP port (``proxy``), the stand-in relaying
to a backend with no picker (``relay``: Envoy's own part), and the stand-in asking the picker
first (``picker``). A front end's added latency is its percentile minus its baseline's
(proxy - direct, picker - relay); the target is the picker's p50 at most 1.5x proxy mode's.
The picker's figure includes the stand-in's Python gRPC client, which Envoy's C++ client
does not cost: it overstates the picker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from loadtest import benchkit
from loadtest.bench_overhead import text_of_tokens
from loadtest.envoy_standin import EnvoyStandIn
from loadtest.ideal import IdealRequest, ideal_hit_rate
from loadtest.procs import free_port, running, start, start_gateway, start_replicas, wait_ready
from loadtest.runner import default_renderer
from router.fleet.probes import parse_vllm_metrics

CHAT = "/v1/chat/completions"
MODEL = "Qwen/Qwen3-0.6B"
PATHS = ("direct", "proxy", "relay", "picker")
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


async def hit_rate_run(mode: str, urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One mode on fresh caches and a fresh gateway: the fleet hit rate and what was sent."""
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
            base = await counters(s, urls)

            async def one(body: dict[str, Any]) -> None:
                nonlocal ok, sent
                async with gate:
                    sent += 1
                    if mode == "proxy":
                        async with s.post(gw.url + CHAT, json=body) as resp:
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


async def latency_run(
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Sequential requests, the four paths interleaved; seconds per request per path."""
    backend_ports = [free_port() for _ in range(args.replicas)]
    backends = [f"http://127.0.0.1:{p}" for p in backend_ports]
    bodies = latency_bodies(args.requests + args.warmup, args.seed)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    cpu_ms: dict[str, float] = {}
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
        await wait_ready(gw.url, "/ready", proc=gw)
        envoy = EnvoyStandIn(f"127.0.0.1:{port}")
        try:
            async with aiohttp.ClientSession() as s:
                for i, body in enumerate(bodies):
                    raw = json.dumps(body).encode()
                    target = backends[i % len(backends)]
                    order = PATHS[i % 4 :] + PATHS[: i % 4]  # no path always first
                    for path in order:
                        t0 = time.perf_counter()
                        if path == "direct":
                            async with s.post(
                                target + CHAT,
                                data=raw,
                                headers={"content-type": "application/json"},
                            ) as r:
                                await r.read()
                                assert r.status == 200
                        elif path == "proxy":
                            async with s.post(
                                gw.url + CHAT,
                                data=raw,
                                headers={"content-type": "application/json"},
                            ) as r:
                                await r.read()
                                assert r.status == 200
                        elif path == "relay":
                            got = await envoy.relay_only(CHAT, raw, target.removeprefix("http://"))
                            assert got.status == 200
                        else:
                            got = await envoy.post(CHAT, raw)
                            assert got.status == 200, got.body
                        if i >= args.warmup:
                            times[path].append(time.perf_counter() - t0)
                # The gateway's own CPU per request on each front end, one after the other.
                for path in ("proxy", "picker"):
                    cpu = gw.cpu_seconds()
                    for body in bodies[args.warmup :]:
                        raw = json.dumps(body).encode()
                        if path == "proxy":
                            async with s.post(gw.url + CHAT, data=raw, headers=JSON) as r:
                                await r.read()
                        else:
                            await envoy.post(CHAT, raw)
                    cpu_ms[path] = (gw.cpu_seconds() - cpu) * 1000 / args.requests
        finally:
            await envoy.close()
    return times, cpu_ms


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with running() as procs:
        sim = start_replicas(args.replicas, "--num-gpu-blocks", str(args.num_gpu_blocks))
        procs.append(sim)
        for mode in ("proxy", "ext_proc"):
            row = await hit_rate_run(mode, sim.urls, args)
            benchkit.progress(
                f"{mode}: fleet hit rate {benchkit.pct(row['hit_rate'])}, {row['ok']}/{row['sent']} ok"
            )
            rows.append(row)
    best = await asyncio.to_thread(ideal, args)
    benchkit.progress("latency: four paths interleaved")
    times, cpu_ms = await latency_run(args)
    n = args.tenants * args.users * args.turns
    print(
        f"Hit rate: {args.tenants} tenants x {args.users} conversations x {args.turns} turns "
        f"({n} requests, system prompts of ~{args.system_tokens} tokens), concurrency "
        f"{args.concurrency}, {args.replicas} simulated replicas ({args.num_gpu_blocks} blocks "
        f"each), seed {args.seed}.\n"
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
    base = {"direct": "direct", "proxy": "direct", "relay": "relay", "picker": "relay"}
    table = []
    for path in PATHS:
        b = base[path]
        table.append(
            (
                path,
                f"{pct(times[path], 50):.2f} ms",
                f"{pct(times[path], 99):.2f} ms",
                "" if b == path else f"{pct(times[path], 50) - pct(times[b], 50):.2f} ms",
                "" if b == path else f"{pct(times[path], 99) - pct(times[b], 99):.2f} ms",
            )
        )
    print(benchkit.markdown("path | p50 | p99 | added p50 | added p99", table))
    proxy_added = pct(times["proxy"], 50) - pct(times["direct"], 50)
    picker_added = pct(times["picker"], 50) - pct(times["relay"], 50)
    print(
        f"\nPicker's added latency / proxy mode's at p50: "
        f"{benchkit.ratio(picker_added, proxy_added)} (target: at most 1.5)"
    )
    print(
        f"The gateway process's CPU per request, {args.requests} requests on each front end "
        f"in turn: proxy {cpu_ms['proxy']:.2f} ms, picker {cpu_ms['picker']:.2f} ms "
        f"({benchkit.ratio(cpu_ms['picker'], cpu_ms['proxy'])})"
    )
    return {
        "hit_rate": rows,
        "ideal": best,
        "cpu_ms_per_request": cpu_ms,
        "latency_ms": {p: [t * 1000 for t in v] for p, v in times.items()},
    }


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
    args = p.parse_args(argv)
    if args.quick:
        args.tenants, args.users, args.turns, args.requests, args.warmup = 3, 2, 2, 40, 5
    out = asyncio.run(amain(args))
    benchkit.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
