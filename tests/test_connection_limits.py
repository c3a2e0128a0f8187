"""Connection-level limits at the socket (issue 18), as a hostile client would probe them:
header count and size (aiohttp's parser: 128 headers, 8,190-byte lines), malformed request
lines and chunked framing, all answered as OpenAI-shaped JSON; a cap on open connections with
a 503 beyond it; a deadline for a request head (slowloris) and for an idle keep-alive
connection. Raw sockets: no client would send these. Each test waits on a socket event (an
answer, an end of file), never on a sleep."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.helpers import chat_body, post, replica_stats, wait_for

EOF_WAIT_S = 30  # a guard for a test that fails, not a synchronisation


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def raw_request(url: str, head: bytes) -> bytes:
    reader, writer = await connect(url)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), EOF_WAIT_S)  # until the server closes
    finally:
        writer.close()


def parse(answer: bytes) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, parsed JSON body) of one raw HTTP response."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return (
        int(lines[0].split(" ", 2)[1]),
        {k.lower(): v for k, v in headers.items()},
        (json.loads(body) if body else None),
    )


def assert_openai_error(body: Any, code: str | None = None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err


async def still_serving(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url + "/v1/chat/completions", chat_body("still here")))[0] == 200


BAD_HEADS = [
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
        + b"\r\n",
        431,
        "header_too_large",
        id="200 headers",
    ),
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        431,
        "header_too_large",
        id="a 20 kB header",
    ),
    pytest.param(
        b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", 431, "header_too_large", id="a 20 kB URL"
    ),
    pytest.param(b"GARBAGE\r\n\r\n", 400, "bad_request_line", id="no request line"),
    pytest.param(b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request_line", id="bad method"),
    pytest.param(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        400,
        "bad_framing",
        id="bad chunk size",
    ),
]


@pytest.mark.parametrize(("head", "status", "code"), BAD_HEADS)
async def test_malformed_requests_get_a_json_4xx_and_the_gateway_serves_on(
    fleet, gateway, head, status, code
):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    got, headers, body = parse(await raw_request(gw.url, head))
    assert got == status, (got, body)
    assert headers["content-type"].startswith("application/json")
    assert_openai_error(body, code)
    assert "Traceback" not in json.dumps(body) and "aaaa" not in json.dumps(body)
    await still_serving(gw.url)


# -- the connection cap -------------------------------------------------------------------
async def test_connections_beyond_the_cap_get_a_503_and_are_closed(fleet, gateway):
    replicas = await fleet(1)
    # The cap alone: every connection here is from one address (tests/test_fair_shares.py:
    # the per-peer shares).
    gw = await gateway([replicas[0].url], max_connections=4, client_share=1.0)
    server = gw.runner.server

    async def opened(n: int) -> Any:
        async def check() -> bool:
            return server.open_connections == n  # type: ignore[union-attr]

        return check

    held = [await connect(gw.url) for _ in range(4)]
    await wait_for(await opened(4), what="4 connections accepted")

    body = json.dumps(chat_body("one too many")).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    status, headers, answer = parse(await raw_request(gw.url, head + body))  # ends in EOF
    assert status == 503 and headers["connection"].lower() == "close"
    assert_openai_error(answer, "overloaded")
    assert "retry-after" in headers

    # A liveness probe is still answered (then that connection is closed too).
    status, headers, answer = parse(
        await raw_request(gw.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    )
    assert status == 200 and answer == {"status": "ok"}
    assert headers["connection"].lower() == "close"

    reader, writer = held.pop()
    writer.close()
    await wait_for(await opened(3), what="a held connection to close")
    await still_serving(gw.url)
    for _, w in held:
        w.close()


# -- request-head and keep-alive deadlines ------------------------------------------------
async def test_a_slow_request_head_gets_a_408_and_is_closed(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], header_timeout_s=0.5)
    answer = await raw_request(gw.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    status, headers, body = parse(answer)  # raw_request returned: the server closed it
    assert status == 408 and headers["connection"] == "close"
    assert_openai_error(body, "header_timeout")
    rejected = gw.gateway.metrics.registry.get_sample_value(
        "prefix_router_rejected_requests_total", {"reason": "header_timeout"}
    )
    assert rejected == 1
    await still_serving(gw.url)


async def health_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """One GET /health on an open keep-alive connection, read to its end: the status."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), EOF_WAIT_S)
    status, headers, _ = parse(head)
    await reader.readexactly(int(headers["content-length"]))
    return status


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], header_timeout_s=0.5)
    assert await raw_request(gw.url, b"") == b""  # EOF, no unsolicited response


async def test_a_keep_alive_connection_trickling_its_next_head_gets_a_408(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], header_timeout_s=0.5, keepalive_timeout_s=60)
    reader, writer = await connect(gw.url)
    try:
        assert await health_on(reader, writer) == 200
        writer.write(b"GET /health HTTP/1.1\r\nHo")  # and never the rest
        status, _, body = parse(await asyncio.wait_for(reader.read(), EOF_WAIT_S))
        assert status == 408
        assert_openai_error(body, "header_timeout")
    finally:
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], keepalive_timeout_s=0.5, header_timeout_s=60)
    reader, writer = await connect(gw.url)
    try:
        assert await health_on(reader, writer) == 200
        # Nothing more is sent: the server ends the connection, silently.
        assert await asyncio.wait_for(reader.read(), EOF_WAIT_S) == b""
    finally:
        writer.close()


async def test_a_request_slower_than_the_head_deadline_but_complete_is_served(fleet, gateway):
    """The deadline is for the head only: a body read (body_timeout_s) or a long answer on a
    connection whose head came in time is not cut by it."""
    replicas = await fleet(1, decode_tokens_per_s=20)
    gw = await gateway([replicas[0].url], header_timeout_s=0.3)
    async with aiohttp.ClientSession() as s:
        # 12 tokens at 20/s: the answer takes longer than the head deadline.
        status, _, body = await post(
            s, gw.url + "/v1/chat/completions", chat_body("slow", max_tokens=12)
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 12


async def test_a_client_gone_before_a_non_streamed_answer_cancels_it_upstream(fleet, gateway):
    """The streamed case is tests/test_gateway.py; here the client closes its socket while
    the replica is still generating a non-streamed answer."""
    replicas = await fleet(1, decode_tokens_per_s=20)
    gw = await gateway([replicas[0].url])
    body = json.dumps(chat_body("a long answer", max_tokens=400)).encode()
    reader, writer = await connect(gw.url)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with aiohttp.ClientSession() as s:

        async def running(n: int) -> Any:
            async def check() -> bool:
                return (await replica_stats(s, replicas[0].url)).running == n

            return check

        await wait_for(await running(1), what="the request to reach the replica")
        writer.close()  # 400 tokens at 20/s: about 20 s of generation left
        await wait_for(await running(0), what="the upstream request to be cancelled")
        assert (
            gw.gateway.metrics.registry.get_sample_value("prefix_router_client_disconnects_total")
            == 1
        )
