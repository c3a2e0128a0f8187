"""The gateway's liveness under hostile traffic: the worst and median ``GET /health`` latency
while each hostile mix runs, next to a benign baseline run in the same run, with the gateway
(auth on, two tenants, flow control, precise mode) in front of simulated replicas on loopback
(each serving five LoRA adapters).

    python -m loadtest.bench_hostile [--seconds 5] [--mixes baseline,gzip_bombs,...]

Each mix runs in a process of its own for ``--seconds`` (after a second of build-up) while a
prober sends ``GET /health`` every 10 ms from 127.0.0.1 and tenant B sends small chat
requests, each on a new connection (so a full connection table shows). The hostile senders
connect from 127.0.0.2: another peer. One replica's KV events come from a hostile publisher
(a process of its own, silent but for the ``kv_*`` mixes: junk live messages, replays of
junk, a 40 MB message, a 15 MB batch of 1.4M events, batches of 65,536 junk events). Printed:
per mix, the probes' p50 and worst latency, the worst minus the baseline's worst (target:
within 50 ms), how many of B's requests were served, the gateway process's peak RSS (sampled
every 20 ms through the mix) and the hostile requests' answers.

Mixes are a list of named coroutines (``MIXES``): a new one is one function and one line
there. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import multiprocessing
import queue
import random
import statistics
import string
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import yaml
import zmq

from loadtest import benchkit
from loadtest.procs import running, start_gateway, start_replicas, wait_ready

KEYS = {"a": "sk-bench-hostile-a-0123456789", "b": "sk-bench-hostile-b-9876543210"}
HOSTILE_PEER = "127.0.0.2"  # every hostile sender's address; the prober and B use 127.0.0.1
MODEL = "Qwen/Qwen3-0.6B"
MAX_CONNECTIONS = 200


@dataclass
class Ctx:
    """What a mix gets: the gateway's address, the stop signal, and where to count answers."""

    url: str
    stop: asyncio.Event
    answers: Counter[str] = field(default_factory=Counter)
    bombs: dict[str, bytes] = field(default_factory=dict)
    kv: Any = None  # the hostile KV event publisher's command queue (kv_publisher)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


Mix = Callable[[Ctx], Awaitable[None]]


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def gzip_bomb() -> bytes:
    """31 MiB of chat JSON (600k one-word messages: a 400 once parsed) in ~30-80 KB."""
    one = b'{"role":"user","content":"x"},'
    raw = (
        b'{"model":"'
        + MODEL.encode()
        + b'","max_tokens":1,"messages":['
        + one * ((31 * 1024 * 1024) // len(one))
        + b'{"role":"user","content":"x"}]}'
    )
    return gzip.compress(raw, 6)


def hostile_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(local_addr=(HOSTILE_PEER, 0), force_close=True)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False)


async def _repeat(
    ctx: Ctx, senders: int, send: Callable[[aiohttp.ClientSession], Awaitable[str]]
) -> None:
    """``senders`` loops of ``send`` from the hostile peer until the mix stops."""

    async def loop() -> None:
        async with hostile_session() as s:
            while not ctx.stop.is_set():
                try:
                    ctx.answers[await send(s)] += 1
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                    ctx.answers[type(e).__name__] += 1
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(loop() for _ in range(senders)))


async def _post_status(
    s: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]
) -> str:
    timeout = aiohttp.ClientTimeout(total=30)
    async with s.post(url, data=data, headers=headers, timeout=timeout) as resp:
        await resp.read()
        return str(resp.status)


# -- the mixes --------------------------------------------------------------------------------
async def baseline(ctx: Ctx) -> None:
    """Nothing hostile: the prober and tenant B alone."""
    await ctx.stop.wait()


async def gzip_bombs(ctx: Ctx) -> None:
    """Tenant A, two senders: 31 KB gzip chat bodies inflating to 31 MiB (each a 400)."""
    headers = {**bearer("a"), "Content-Type": "application/json", "Content-Encoding": "gzip"}
    bomb = ctx.bombs["gzip"]
    await _repeat(
        ctx, 2, lambda s: _post_status(s, ctx.url + "/v1/chat/completions", bomb, headers)
    )


async def explain_bombs(ctx: Ctx) -> None:
    """No key, two senders: the same bombs to /v1/route/explain."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    bomb = ctx.bombs["gzip"]
    await _repeat(ctx, 2, lambda s: _post_status(s, ctx.url + "/v1/route/explain", bomb, headers))


async def _trickle(ctx: Ctx, path: str, auth: bool) -> None:
    """One connection sending a 1 MB body one byte every 0.2 s, reopened when refused."""
    host, port = ctx.host_port
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: 1000000\r\n"
        + (f"Authorization: Bearer {KEYS['a']}\r\n" if auth else "")
        + "\r\n"
    ).encode()
    while not ctx.stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(HOSTILE_PEER, 0))
        except OSError as e:
            ctx.answers[type(e).__name__] += 1
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(head)
            while not ctx.stop.is_set() and not reader.at_eof():
                writer.write(b" ")
                await writer.drain()
                with contextlib.suppress(asyncio.TimeoutError):
                    line = await asyncio.wait_for(reader.readline(), 0.2)
                    if line.startswith(b"HTTP/1.1"):
                        ctx.answers[line.split()[1].decode()] += 1
                        break
        except OSError as e:
            ctx.answers[type(e).__name__] += 1
        finally:
            writer.close()


async def trickled_bodies(ctx: Ctx) -> None:
    """20 connections trickling bodies: 10 of tenant A's to chat, 10 keyless to explain."""
    tasks = [_trickle(ctx, "/v1/chat/completions", True) for _ in range(10)]
    tasks += [_trickle(ctx, "/v1/route/explain", False) for _ in range(10)]
    await asyncio.gather(*tasks)


async def byte_budget_hog(ctx: Ctx) -> None:
    """Tenant A, 16 connections each announcing a 32 MiB body, sending 4 MiB of it and
    holding; reopened when refused or timed out."""
    host, port = ctx.host_port
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {32 * 1024 * 1024}\r\nAuthorization: Bearer {KEYS['a']}\r\n\r\n"
    ).encode()
    chunk = b" " * (4 * 1024 * 1024)

    async def hold() -> None:
        while not ctx.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(HOSTILE_PEER, 0)
                )
            except OSError as e:
                ctx.answers[type(e).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            try:
                writer.write(head + chunk)
                await writer.drain()
                stop = asyncio.ensure_future(ctx.stop.wait())
                line = asyncio.ensure_future(reader.readline())
                await asyncio.wait({stop, line}, return_when=asyncio.FIRST_COMPLETED)
                if line.done() and line.result().startswith(b"HTTP/1.1"):
                    ctx.answers[line.result().split()[1].decode()] += 1
                    await asyncio.sleep(0.05)
                stop.cancel()
                line.cancel()
            except OSError as e:
                ctx.answers[type(e).__name__] += 1
            finally:
                writer.close()

    await asyncio.gather(*(hold() for _ in range(16)))


async def connection_hog(ctx: Ctx) -> None:
    """Every one of the gateway's connection slots: keyless keep-alive connections that did
    one GET /health, reopened as soon as one is closed."""
    host, port = ctx.host_port

    async def hold() -> None:
        while not ctx.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(HOSTILE_PEER, 0)
                )
            except OSError as e:
                ctx.answers[type(e).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
                line = await reader.readline()
                if line.startswith(b"HTTP/1.1"):
                    ctx.answers[line.split()[1].decode()] += 1
                stop = asyncio.ensure_future(ctx.stop.wait())
                eof = asyncio.ensure_future(reader.read())  # held until the gateway closes it
                await asyncio.wait({stop, eof}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                eof.cancel()
            except OSError as e:
                ctx.answers[type(e).__name__] += 1
            finally:
                writer.close()

    await asyncio.gather(*(hold() for _ in range(MAX_CONNECTIONS)))


async def spaces_prompt(ctx: Ctx) -> None:
    """Tenant A, one sender: chat prompts of 3.9M spaces (a 413 within the tokenize budget)."""
    body = json.dumps(
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": " " * 3_900_000}],
        }
    ).encode()
    headers = {**bearer("a"), "Content-Type": "application/json"}
    await _repeat(
        ctx, 1, lambda s: _post_status(s, ctx.url + "/v1/chat/completions", body, headers)
    )


async def valid_large_bodies(ctx: Ctx) -> None:
    """Tenant A, one sender: bodies within every limit but near the 1M-value cap, one of
    each in turn: a completions prompt of 990k token ids (a 400: over the context once
    parsed) and a chat whose structured-output schema has an enum of 990k strings
    (forwarded)."""
    prompt = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": [1000] * 990_000})
    schema = {"type": "string", "enum": [f"v{i}" for i in range(990_000)]}
    chat = json.dumps(
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "pick one"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "choice", "schema": schema},
            },
        }
    )
    bodies = [("/v1/completions", prompt.encode()), ("/v1/chat/completions", chat.encode())]
    headers = {**bearer("a"), "Content-Type": "application/json"}
    turn = 0

    async def send(s: aiohttp.ClientSession) -> str:
        nonlocal turn
        path, body = bodies[turn % len(bodies)]
        turn += 1
        return await _post_status(s, ctx.url + path, body, headers)

    await _repeat(ctx, 1, send)


ADAPTERS = [f"bench-lora-{i}" for i in range(5)]  # LoRA adapters every replica serves


async def adapter_flood(ctx: Ctx) -> None:
    """Tenant A, 12 senders: chat requests spread over the five LoRA adapters' names, each
    a new ~1,500-token prompt (all prefill), flooding the fleet's prefill slots. Flow control
    keys them by the base model: they queue with B's requests, which go in their fair turn."""
    headers = {**bearer("a"), "Content-Type": "application/json"}
    turn = 0

    async def send(s: aiohttp.ClientSession) -> str:
        nonlocal turn
        turn += 1
        words = " ".join(f"w{turn}x{i}" for i in range(500))
        body = {
            "model": ADAPTERS[turn % len(ADAPTERS)],
            "max_tokens": 16,
            "messages": [{"role": "user", "content": words}],
        }
        return await _post_status(
            s, ctx.url + "/v1/chat/completions", json.dumps(body).encode(), headers
        )

    await _repeat(ctx, 12, send)


async def random_model_names(ctx: Ctx) -> None:
    """Tenant A, four senders: small chat bodies each naming a new random 200-character
    model (issue 39, item 9: each a 404, or a 503 before any replica's /v1/models has
    answered; none leaves a metric label, registry entry or queue behind)."""
    rng = random.Random(39)
    headers = {**bearer("a"), "Content-Type": "application/json"}

    async def send(s: aiohttp.ClientSession) -> str:
        name = "".join(rng.choices(string.ascii_letters, k=200))
        body = {"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        return await _post_status(
            s, ctx.url + "/v1/chat/completions", json.dumps(body).encode(), headers
        )

    await _repeat(ctx, 4, send)


HELD_PAD = 8_000_000  # each of held_bodies' three extra fields (max_string_chars is 8 MiB)


async def held_bodies(ctx: Ctx) -> None:
    """Tenant A, 8 senders: chat requests of a 3-word prompt with 24 MB of extra fields,
    gzipped to ~24 KB, max_tokens 4000, filling the prefill slots so that they queue (issue
    39, item 1). Each held request is charged twice its decoded size against A's share of
    the held-bytes budget (256 MiB of 1 GiB by default): a few are held, the rest refused
    (429 held_bytes_exceeded) before they are parsed, and the gateway's RSS stays bounded."""
    body = {
        "model": MODEL,
        "max_tokens": 4000,  # 2 s of the simulator's decode: the slots stay full, A queues
        "messages": [{"role": "user", "content": "three word prompt"}],
        **{f"metadata_{i}": "x" * HELD_PAD for i in range(3)},
    }
    data = await asyncio.to_thread(gzip.compress, json.dumps(body).encode(), 6)
    headers = {**bearer("a"), "Content-Type": "application/json", "Content-Encoding": "gzip"}
    await _repeat(
        ctx, 8, lambda s: _post_status(s, ctx.url + "/v1/chat/completions", data, headers)
    )


async def batch_flood(ctx: Ctx) -> None:
    """Tenant A, 8 senders: completions batches of "hi" and eight new ~1,900-token prompts
    (max_tokens 16), issue 39 item 2: priced by all nine prompts (tpm, fair-queue cost,
    slot timer), not by "hi", so B's requests get their fair turn."""
    headers = {**bearer("a"), "Content-Type": "application/json"}
    turn = 0

    async def send(s: aiohttp.ClientSession) -> str:
        nonlocal turn
        turn += 1
        prompts = [" ".join(f"w{turn}p{p}x{i}" for i in range(630)) for p in range(8)]
        body = {"model": MODEL, "max_tokens": 16, "prompt": ["hi", *prompts]}
        return await _post_status(
            s, ctx.url + "/v1/completions", json.dumps(body).encode(), headers
        )

    await _repeat(ctx, 8, send)


# -- a hostile KV event publisher (the gateway runs in precise mode: one replica's events
# come from it) ---------------------------------------------------------------------------
KV_MESSAGES = 20_000  # junk messages per live or replay attack


def kv_publisher(ports: Any, commands: Any, done: Any) -> None:
    """In a process of its own (its CPU is a remote peer's): binds the event and replay
    sockets, reports them on ``ports``, and runs each attack named on ``commands`` until
    ``done``. Between attacks it is silent and answers replays with nothing."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    replay = ctx.socket(zmq.ROUTER)
    for sock in (pub, replay):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind("tcp://127.0.0.1:*")
    ports.put(
        (pub.getsockopt_string(zmq.LAST_ENDPOINT), replay.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(replay, zmq.POLLIN)
    seq = 1000
    junk_replays = False
    end = (-1).to_bytes(8, "big", signed=True)

    def s8(n: int) -> bytes:
        return n.to_bytes(8, "big")

    while not done.is_set():
        for sock, _ in poller.poll(20):
            frames = sock.recv_multipart()  # a subscription on pub: nothing to answer
            if sock is replay and junk_replays:  # in sequence, payloads that are not msgpack
                client, start = frames[0], int.from_bytes(frames[-1], "big")
                for i in range(KV_MESSAGES):
                    replay.send_multipart((client, b"", b"", s8(start + 1 + i), b"\xc1junk"))
                replay.send_multipart((client, b"", b"", end, b""))
            elif sock is replay:
                replay.send_multipart((frames[0], b"", b"", end, b""))
        try:
            attack = commands.get_nowait()
        except queue.Empty:
            continue
        junk_replays = attack == "kv_junk_replay"
        if attack == "kv_junk_live":  # wrong frame counts, bad sequence frames, not msgpack
            for i in range(KV_MESSAGES):
                if i % 3 == 0:
                    pub.send_multipart((b"", b"short"))
                elif i % 3 == 1:
                    pub.send_multipart((b"", b"bad seq", b"x"))
                else:
                    pub.send_multipart((b"", s8(seq + i), b"\xc1 not msgpack"))
            seq += KV_MESSAGES
        elif attack == "kv_junk_replay":  # gaps, each answered on replay with junk
            for _ in range(3):
                seq += 100
                pub.send_multipart((b"", s8(seq), msgpack.packb([1.0, [], 0])))
        elif attack == "kv_batch_40mb":  # over the message cap: ZMQ drops the peer
            pub.send_multipart((b"", s8(seq), b"\x00" * (40 << 20)))
            seq += 1
        elif attack in ("kv_batch_15mb", "kv_65k_events"):
            n = 1_400_000 if attack == "kv_batch_15mb" else 65_536
            events = msgpack.packb({"type": "XXXX"}) * n
            head = b"\x93" + msgpack.packb(1.0) + b"\xdd" + n.to_bytes(4, "big")
            for i in range(1 if n > 65_536 else 20):
                pub.send_multipart((b"", s8(seq + i), head + events + msgpack.packb(0)))
            seq += 20
    ctx.destroy(linger=0)


def _kv_attack(name: str) -> Mix:
    async def mix(ctx: Ctx) -> None:
        while not ctx.stop.is_set():  # the attack again every second
            ctx.kv.put(name)
            ctx.answers["attacks"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), 1.0)

    mix.__doc__ = f"The KV event publisher's {name} attack, once a second."
    return mix


kv_junk_live = _kv_attack("kv_junk_live")  # 20,000 junk live messages
kv_junk_replay = _kv_attack("kv_junk_replay")  # gaps whose replays are 20,000 junk replies
kv_batch_40mb = _kv_attack("kv_batch_40mb")  # one 40 MB message
kv_batch_15mb = _kv_attack("kv_batch_15mb")  # 1.4M junk events in one 15 MB batch
kv_65k_events = _kv_attack("kv_65k_events")  # 20 batches of 65,536 junk events (at the cap)


# The mixes in the order they run; ``baseline`` first. Add a mix here (name, coroutine).
MIXES: list[tuple[str, Mix]] = [
    ("baseline", baseline),
    ("gzip_bombs", gzip_bombs),
    ("explain_bombs", explain_bombs),
    ("trickled_bodies", trickled_bodies),
    ("byte_budget_hog", byte_budget_hog),
    ("connection_hog", connection_hog),
    ("spaces_prompt", spaces_prompt),
    ("valid_large_bodies", valid_large_bodies),
    ("kv_junk_live", kv_junk_live),
    ("kv_junk_replay", kv_junk_replay),
    ("kv_batch_40mb", kv_batch_40mb),
    ("kv_batch_15mb", kv_batch_15mb),
    ("kv_65k_events", kv_65k_events),
    ("adapter_flood", adapter_flood),
    ("random_model_names", random_model_names),
    ("held_bodies", held_bodies),
    ("batch_flood", batch_flood),
]


# -- measuring --------------------------------------------------------------------------------
async def probe(url: str, stop: asyncio.Event, lags: list[float]) -> None:
    """GET /health every 10 ms (one keep-alive connection, reopened if closed)."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
                    if r.status == 200:
                        lags.append(time.perf_counter() - t0)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                lags.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)


async def benign(url: str, stop: asyncio.Event, served: Counter[str]) -> None:
    """Tenant B: small chat requests, one at a time, each on a new connection."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        while not stop.is_set():
            try:
                async with s.post(
                    url + "/v1/chat/completions",
                    json=body,
                    headers=bearer("b"),
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as r:
                    await r.read()
                    served[str(r.status)] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                served[type(e).__name__] += 1
            await asyncio.sleep(0.05)


def _hostile_main(name: str, url: str, seconds: float, conn: Any, kv: Any) -> None:
    """In a process of its own (so its client work does not delay the prober): run mix
    ``name`` for ``seconds``, then send back how the gateway answered it."""

    async def run() -> dict[str, int]:
        ctx = Ctx(url, asyncio.Event(), kv=kv)
        if name in ("gzip_bombs", "explain_bombs"):
            ctx.bombs["gzip"] = gzip_bomb()
        conn.send("ready")
        asyncio.get_running_loop().call_later(seconds, ctx.stop.set)
        task = asyncio.ensure_future(dict(MIXES)[name](ctx))
        await ctx.stop.wait()
        try:
            await asyncio.wait_for(task, 35)
        except asyncio.TimeoutError:
            task.cancel()
        return dict(ctx.answers.most_common(4))

    conn.send(asyncio.run(run()))


async def peak_rss(rss: Callable[[], float], stop: asyncio.Event, peak: list[float]) -> None:
    """The gateway process's highest RSS (MB), sampled every 20 ms until ``stop``."""
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        await asyncio.sleep(0.02)


async def run_mix(
    url: str,
    name: str,
    seconds: float,
    kv: Any = None,
    rss: Callable[[], float] = lambda: float("nan"),
) -> dict[str, Any]:
    parent, child = multiprocessing.get_context("spawn").Pipe()
    peak = [rss()]
    sampling_stop = asyncio.Event()
    sampling = asyncio.ensure_future(peak_rss(rss, sampling_stop, peak))
    build_up = min(1.0, seconds / 5)  # the hostile load builds up before measuring
    proc = multiprocessing.get_context("spawn").Process(
        target=_hostile_main, args=(name, url, build_up + seconds, child, kv), daemon=True
    )
    proc.start()
    try:
        ready = await asyncio.to_thread(parent.poll, 60)
        if not ready or parent.recv() != "ready":
            raise RuntimeError(f"mix {name} did not start")
        await asyncio.sleep(build_up)
        lags: list[float] = []
        served: Counter[str] = Counter()
        stop = asyncio.Event()
        measuring = asyncio.gather(probe(url, stop, lags), benign(url, stop, served))
        await asyncio.sleep(seconds)
        stop.set()
        await measuring
        answers = (
            await asyncio.to_thread(parent.recv) if await asyncio.to_thread(parent.poll, 60) else {}
        )
    finally:
        sampling_stop.set()
        await sampling
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()
    return {
        "peak_rss_mb": peak[0],
        "mix": name,
        "probes": len(lags),
        "p50_ms": statistics.median(lags) * 1e3 if lags else float("nan"),
        "p99_ms": statistics.quantiles(lags, n=100, method="inclusive")[98] * 1e3
        if len(lags) > 1
        else float("nan"),
        "worst_ms": max(lags) * 1e3 if lags else float("nan"),
        "b_ok": served.get("200", 0),
        "b_sent": sum(served.values()),
        "b_other": dict(c for c in served.items() if c[0] != "200"),
        "hostile": answers,
    }


def table(rows: list[dict]) -> str:
    base = rows[0]["worst_ms"]
    base_rss = rows[0]["peak_rss_mb"]
    cells = []
    for r in rows:
        delta = r["worst_ms"] - base
        b_other = f" {r['b_other']}" if r["b_other"] else ""
        cells.append(
            (
                r["mix"],
                r["probes"],
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['worst_ms']:.1f}",
                f"{delta:+.1f}{'' if delta <= 50 else ' (over 50)'}",
                f"{r['b_ok']}/{r['b_sent']}{b_other}",
                f"{r['peak_rss_mb']:.0f} ({r['peak_rss_mb'] - base_rss:+.0f})",
                r["hostile"] or "-",
            )
        )
    return benchkit.markdown(
        "mix | /health probes | p50 ms | p99 ms | worst ms | worst - baseline worst | "
        "B served | gateway peak RSS MB (vs baseline) | hostile answers",
        cells,
    )


def _gateway_flags(tmp: Path, hostile: str, event_ep: str, replay_ep: str) -> list[str]:
    """Auth on with tenants a and b, the connection cap, and precise mode with replica
    ``hostile``'s KV events coming from the hostile publisher (the other replica has none)."""
    keys, config = tmp / "keys.yaml", tmp / "gateway.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": {t: {"keys": [k]} for t, k in KEYS.items()},
                "salt_secrets": [{"secret": "bench-hostile-secret-0123456789abcdef"}],
            }
        )
    )
    endpoints = {hostile: {"endpoint": event_ep, "replay_endpoint": replay_ep}}
    config.write_text(yaml.safe_dump({"kv_events": {"enabled": True, "endpoints": endpoints}}))
    return [
        "--config",
        str(config),
        "--auth",
        "--api-keys-file",
        str(keys),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--flow-control",  # tenants share saturated replicas fairly (adapter_flood)
    ]


async def amain(args: argparse.Namespace) -> list[dict]:
    names = benchkit.subset(args.mixes, [n for n, _ in MIXES], "mix")
    if names[0] != "baseline":
        names.insert(0, "baseline")
    rows = []
    mp = multiprocessing.get_context("spawn")
    ports, kv, done = mp.Queue(), mp.Queue(), mp.Event()
    publisher = mp.Process(target=kv_publisher, args=(ports, kv, done), daemon=True)
    publisher.start()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp, running() as procs:
            event_ep, replay_ep = await asyncio.to_thread(ports.get, True, 60)
            sim = start_replicas(2, "--lora", *ADAPTERS)
            procs.append(sim)
            gw = start_gateway(
                sim.urls,
                *_gateway_flags(Path(tmp), sim.urls[1], event_ep, replay_ep),
                *args.gateway_args,
            )
            procs.append(gw)
            await wait_ready(gw.url, proc=gw)
            await run_mix(gw.url, "baseline", 1.0)  # a warm-up: first requests' one-off costs
            for name in names:
                row = await run_mix(gw.url, name, args.seconds, kv, gw.rss_mb)
                rows.append(row)
                benchkit.progress(
                    f"{name}: /health p50 {row['p50_ms']:.1f} ms, worst {row['worst_ms']:.1f} "
                    f"ms, B {row['b_ok']}/{row['b_sent']}, hostile {row['hostile']}"
                )
    finally:
        done.set()
        await asyncio.to_thread(publisher.join, 10)
        if publisher.is_alive():
            publisher.kill()
    print(
        f"Gateway with auth on (tenants a, b), flow control on, 2 simulated replicas "
        f"(5 LoRA adapters each), max_connections {MAX_CONNECTIONS}, precise mode (one replica's KV events from a hostile publisher); "
        f"each mix {args.seconds:g} s; hostile senders from {HOSTILE_PEER}.\n"
    )
    print(table(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser(
        "loadtest.bench_hostile", __doc__, seconds=(5.0, "measured seconds per mix"), json=True
    )
    benchkit.add_subset(p, "--mixes", [n for n, _ in MIXES])
    p.add_argument(
        "--gateway-arg",
        dest="gateway_args",
        action="append",
        default=[],
        help="an extra flag for prefix-router serve (repeatable, e.g. --gateway-arg=--workers=2)",
    )
    args = p.parse_args(argv)
    benchkit.write_json(args.json, asyncio.run(amain(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
