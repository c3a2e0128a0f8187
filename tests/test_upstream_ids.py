"""A pooled upstream connection never hands one request another's answer (issue 28, item 11):
a response whose X-Request-Id is another request's, or bytes waiting on an idle connection
before a request is written (a late or unsolicited answer from a misbehaving replica), close
the connection; the request is sent again on a fresh one before its first byte, or fails.
Against real misbehaving socket servers."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.upstream import UpstreamError, UpstreamPool
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


async def test_a_replica_always_naming_another_request_fails_the_request(raw_replica):  # noqa: F811
    async def wrong(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(answer({"for": "someone"}, "someone-else"))

    server = await raw_replica(wrong)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    try:
        with pytest.raises(UpstreamError, match="X-Request-Id"):
            await _ask(pool, server.url, "mine")
    finally:
        pool.close()


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
