"""``/health`` latency while a hostile KV event publisher floods a precise-mode gateway.

    python -m loadtest.bench_kv_junk [--seconds 3] [--messages 20000]

One gateway (``--kv-events``) in this process in front of one simulated replica, whose event
endpoints are a hostile publisher in a child process (its own CPU, as a remote peer would
be). For each mix the prober sends ``GET /health`` back to back for ``--seconds`` while the
publisher attacks (from a child process: a stalled loop shows as latency, not as fewer
samples), and
the worst and p99 latency are printed next to the benign baseline
(the publisher connected and silent) measured in the same run:

* ``junk live``: ``--messages`` live messages of wrong frame counts, bad sequence frames and
  non-msgpack payloads, as fast as the socket takes them;
* ``junk replay``: live messages that leave gaps, each answered on the replay socket with
  ``--messages`` replies in sequence whose payloads are not msgpack;
* ``batch 40 MB``: one 40 MB message (over the gateway's message cap: ZMQ drops the peer);
* ``batch 15 MB``: one 15 MB batch of 1.4M junk events (under the size cap, over the events
  cap: refused unread);
* ``65k events``: one batch of 65,536 junk events (at the cap: decoded and counted a slice at a
  time), sent 20 times.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing as mp
import time
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq

from loadtest import benchkit
from loadtest.replica import SimConfig, SimReplica
from router.app import start_gateway
from router.bundled import tokenizer_dir
from router.config import load_config
from router.prompt import Renderer

MIXES = ("benign", "junk live", "junk replay", "batch 40 MB", "batch 15 MB", "65k events")


def publisher(mix: str, messages: int, ports: Any, go: Any, done: Any) -> None:
    """The hostile publisher (a child process): binds PUB and ROUTER, reports the ports,
    attacks once ``go`` is set, serves replays until ``done``."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.setsockopt(zmq.SNDHWM, 0)
    replay.bind("tcp://127.0.0.1:*")
    ports.put(
        (pub.getsockopt_string(zmq.LAST_ENDPOINT), replay.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(replay, zmq.POLLIN)
    attacked = False
    seq = 1000

    def s8(n: int) -> bytes:
        return n.to_bytes(8, "big")

    while not done.is_set():
        for sock, _ in poller.poll(20):
            frames = sock.recv_multipart()
            if sock is replay and mix == "junk replay" and attacked:
                client, start = frames[0], int.from_bytes(frames[-1], "big")
                for i in range(messages):  # in sequence, unreadable payloads
                    replay.send_multipart((client, b"", b"", s8(start + 1 + i), b"\xc1junk"))
                replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
            elif sock is replay:
                replay.send_multipart(
                    (frames[0], b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
                )
        if go.is_set() and not attacked:
            attacked = True
            if mix == "junk live":
                for i in range(messages):
                    kind = i % 3
                    if kind == 0:
                        pub.send_multipart((b"", b"short"))
                    elif kind == 1:
                        pub.send_multipart((b"", b"bad seq", b"x"))
                    else:
                        pub.send_multipart((b"", s8(seq + i), b"\xc1 not msgpack"))
            elif mix == "junk replay":
                for _ in range(3):
                    seq += 100
                    pub.send_multipart((b"", s8(seq), msgpack.packb([1.0, [], 0])))
            elif mix == "batch 40 MB":
                pub.send_multipart((b"", s8(seq), b"\x00" * (40 << 20)))
            elif mix in ("batch 15 MB", "65k events"):
                n = 1_400_000 if mix == "batch 15 MB" else 65_536
                events = msgpack.packb({"type": "XXXX"}) * n
                head = b"\x93" + msgpack.packb(1.0) + b"\xdd" + n.to_bytes(4, "big")
                for i in range(1 if n > 65_536 else 20):
                    pub.send_multipart((b"", s8(seq + i), head + events + msgpack.packb(0)))
    ctx.destroy(linger=0)


def probe(url: str, seconds: float, out_q: Any = None) -> list[float]:
    """``GET /health`` back to back, 2 ms apart, from a child process (a client of its own:
    a stalled loop shows in the latency, not in fewer samples)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    conn = http.client.HTTPConnection(host or "127.0.0.1", port, timeout=30)
    out = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            out.append(time.perf_counter() - t0)
            time.sleep(0.002)
    finally:
        conn.close()
    if out_q is not None:
        out_q.put(out)
    return out


async def run(mix: str, args: argparse.Namespace, renderer: Renderer) -> dict[str, Any]:
    mpctx = mp.get_context("spawn")
    ports, go, done = mpctx.Queue(), mpctx.Event(), mpctx.Event()
    proc = mpctx.Process(target=publisher, args=(mix, args.messages, ports, go, done))
    proc.start()
    sim = SimReplica(SimConfig(), renderer=renderer)
    gw = None
    try:
        pub_ep, replay_ep = await asyncio.to_thread(ports.get, True, 30)
        url = await sim.start()
        config = load_config(
            env={},
            replicas=[url],
            kv_events=True,
            kv_events_endpoints={url: {"endpoint": pub_ep, "replay_endpoint": replay_ep}},
        )
        gw = await start_gateway(config, renderer, port=0)
        sub = gw.gateway.kv_events
        assert sub is not None
        stream = sub.streams[url]
        await sub.wait(lambda: stream.connected, timeout=10)
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        go.set()
        results = mpctx.Queue()
        prober = mpctx.Process(target=probe, args=(gw.url, args.seconds, results))
        prober.start()
        lat = await asyncio.to_thread(results.get, True, args.seconds + 60)
        await asyncio.to_thread(prober.join, 10)
        lat.sort()
        return {
            "worst_ms": lat[-1] * 1000,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1000,
            "probes": len(lat),
            "errors": sum(stream.errors.values()),
        }
    finally:
        done.set()
        if gw is not None:
            await gw.stop()
        await sim.stop()
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()


async def main_async(args: argparse.Namespace) -> None:
    renderer = await asyncio.to_thread(Renderer.from_pretrained, str(tokenizer_dir()))
    table = benchkit.Text(
        [("mix", 14), ("worst ms", 10), ("p99 ms", 9), ("vs benign", 11), ("probes", 8)]
        + [("  junk counted", 0, "<")]
    )
    print(table.head())
    base = None
    for mix in args.mixes:
        r = await run(mix, args, renderer)
        base = base if base is not None else r["worst_ms"]
        cells = (mix, f"{r['worst_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['worst_ms'] - base:+.1f}")
        print(table.row((*cells, r["probes"], f"  {r['errors']}")), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = benchkit.parser(
        "loadtest.bench_kv_junk", __doc__, seconds=(3.0, "probing time per mix"), whole_doc=True
    )
    p.add_argument("--messages", type=int, default=20_000, help="junk messages per attack")
    p.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
