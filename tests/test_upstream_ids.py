"""A pooled upstream connection never hands one request another's answer (issue 28, item 11):
a response whose X-Request-Id is another request's, or bytes waiting on an idle connection
before a request is written (a late or unsolicited answer from a misbehaving replica), close
the connection; the request is sent again on a fresh one before its first byte, or fails.
Against real misbehaving socket servers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from router.upstream.client import UpstreamPool
from tests.helpers import chat_body, post, serve
from tests.test_proxy_security import parse_head, raw_replica  # noqa: F401  (the fixture)


def answer(obj: dict[str, str], request_id: str | None) -> bytes:
    data = json.dumps(obj).encode()
    rid = f"X-Request-Id: {request_id}\r\n".encode() if request_id is not None else b""
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + rid
        + b"Content-Length: "
        + str(len(data)).encode()
        + b"\r\n\r\n"
        + data
    )


async def _ask(pool: UpstreamPool, url: str, request_id: str) -> dict[str, str]:
    resp = await pool.post(url + "/v1/x", b"{}", {"X-Request-Id": request_id})
    assert resp.status == 200
    return dict(json.loads(await resp.read()))


async def test_an_answer_naming_another_request_is_never_delivered(raw_replica):  # noqa: F811
    """The replica answers the second request on a connection first with a late answer to
    the first one (as if it had been sent late), then with the right one."""
    # connection -> the last request id it answered (the writer itself as the key: an id()
    # of a closed connection's writer can come back for a new one)
    served: dict[asyncio.StreamWriter, str] = {}

    async def late(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        rid = parse_head(head)["x-request-id"]
        previous = served.get(w)
        if previous is not None:
            w.write(answer({"for": previous}, previous))  # the late one, for someone else
        w.write(answer({"for": rid}, rid))
        served[w] = rid

    server = await raw_replica(late)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    try:
        for n in range(4):
            assert await _ask(pool, server.url, f"req-{n}") == {"for": f"req-{n}"}
        # Each request after the first found the pooled connection poisoned: a fresh one.
        assert server.connections == 4
    finally:
        pool.close()


async def test_a_replica_always_naming_an_earlier_request_fails_the_request(raw_replica):  # noqa: F811
    """Every answer names the first request sent on its connection: the first is its own,
    every later one on that connection is crossed, and so is the fresh connection's retry
    once it has answered one."""
    first: dict[asyncio.StreamWriter, str] = {}

    async def stuck(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        rid = first.setdefault(w, parse_head(head)["x-request-id"])
        w.write(answer({"for": rid}, rid))

    server = await raw_replica(stuck)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    try:
        assert await _ask(pool, server.url, "one") == {"for": "one"}
        # The pooled connection answers "one" again: crossed; the fresh one answers "two".
        assert await _ask(pool, server.url, "two") == {"for": "two"}
        assert server.connections == 2
    finally:
        pool.close()


async def test_an_id_never_sent_is_a_hop_that_rewrites_ids(raw_replica):  # noqa: F811
    """A proxy in front of the replica answers with ids of its own (issue 39, item 6): each
    answer is the request's, and the pool says so once per answer."""
    n = 0

    async def rewrites(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        nonlocal n
        n += 1
        w.write(answer({"for": parse_head(head)["x-request-id"]}, f"hop-{n}"))

    server = await raw_replica(rewrites)
    seen: list[str] = []
    pool = UpstreamPool(connect_timeout=5, read_timeout=5, on_rewritten_id=seen.append)
    try:
        for i in range(3):
            assert await _ask(pool, server.url, f"mine-{i}") == {"for": f"mine-{i}"}
        assert seen == [server.url] * 3
        assert server.connections == 1  # kept alive: nothing was wrong with the connection
    finally:
        pool.close()


async def test_a_fleet_behind_an_id_rewriting_proxy_is_served(fleet, gateway):
    """A simulated replica behind a tiny proxy that sets its own X-Request-Id: every request
    through the gateway is answered (it was 502 "X-Request-Id is another request's"), the
    metric counts them, the log says it once."""
    (replica,) = await fleet(1)
    upstream = aiohttp.ClientSession()
    count = 0

    async def proxy(request: web.Request) -> web.StreamResponse:
        nonlocal count
        count += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with upstream.request(
            request.method,
            replica.url + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as resp:
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type",)}
            out["X-Request-Id"] = f"proxy-{count}"
            return web.Response(status=resp.status, body=body, headers=out)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    runner, url = await serve(app)
    try:
        gw = await gateway([url])
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                status, headers, body = await post(
                    s, gw.url + "/v1/chat/completions", chat_body(f"hello {i}")
                )
                assert status == 200, body
            async with s.get(gw.url + "/metrics") as resp:
                page = await resp.text()
        line = f'prefix_router_upstream_rewritten_request_ids_total{{replica="{url}"}} 4.0'
        assert line in page
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_bytes_waiting_on_an_idle_connection_are_nobodys_answer(raw_replica):  # noqa: F811
    """An unsolicited answer (no request id on it) sits in the idle connection's socket,
    not yet read by the loop, when the next request is about to be written."""
    writers: list[asyncio.StreamWriter] = []

    async def echo(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        w.write(answer({"for": parse_head(head)["x-request-id"]}, None))

    server = await raw_replica(echo)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    try:
        assert await _ask(pool, server.url, "first") == {"for": "first"}
        writers[-1].write(answer({"for": "nobody"}, None))  # in the socket now, unread
        assert await _ask(pool, server.url, "second") == {"for": "second"}
        assert server.connections == 2
    finally:
        pool.close()


async def test_answers_without_a_request_id_still_reuse_the_connection(raw_replica):  # noqa: F811
    """vLLM without --enable-request-id-headers echoes nothing: no id is no mismatch."""

    async def plain(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(answer({"for": parse_head(head)["x-request-id"]}, None))

    server = await raw_replica(plain)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    try:
        for n in range(3):
            assert await _ask(pool, server.url, f"r{n}") == {"for": f"r{n}"}
        assert server.connections == 1
    finally:
        pool.close()
