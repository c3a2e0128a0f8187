"""The proxy path's HTTP/1.1 client (router/upstream/client.py) against a raw asyncio server on a
loopback socket that answers in the ways real servers do: by length, chunked, until close,
dropping idle keep-alive connections, hanging, or sending garbage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from router.upstream.client import READ_AHEAD_BYTES, UpstreamError, UpstreamPool


@dataclass
class RawServer:
    """Answers each request with ``reply(request_bytes, writer)``; counts connections.
    ``writer.served`` is how many requests that connection answered before this one."""

    reply: Callable[[bytes, asyncio.StreamWriter], object]
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.served = 0  # type: ignore[attr-defined]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                result = self.reply(head + body, writer)
                if asyncio.iscoroutine(result):
                    await result
                writer.served += 1  # type: ignore[attr-defined]
                await writer.drain()
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., object]]:
    servers: list[asyncio.base_events.Server] = []

    async def start(reply: Callable[[bytes, asyncio.StreamWriter], object]) -> RawServer:
        raw = RawServer(reply)
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return raw

    yield start
    for s in servers:
        s.close()


def fixed(body: bytes, extra: bytes = b"") -> Callable[[bytes, asyncio.StreamWriter], None]:
    def reply(_: bytes, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + extra
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    return reply


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given(serve):
    server = await serve(fixed(b'{"ok":true}', b"X-Upstream: yes\r\n"))
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    for i in range(5):
        resp = await pool.post(server.url + "/v1/chat/completions?x=1", b"{}" * i, {"A": "b"})
        assert resp.status == 200
        assert resp.header("x-upstream") == "yes"
        assert await resp.read() == b'{"ok":true}'
    assert server.connections == 1
    first = server.requests[3]
    assert first.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    assert b"\r\nA: b\r\n" in first and b"\r\nContent-Length: 6\r\n" in first
    assert first.endswith(b"\r\n\r\n{}{}{}")
    pool.close()


async def test_chunked_and_close_delimited_bodies(serve):
    def chunked(_: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    def until_close(_: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        w.close()

    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    a, b = await serve(chunked), await serve(until_close)
    resp = await pool.post(a.url + "/", b"{}", {})
    assert b"".join([c async for c in resp.iter_chunks()]) == b"hello world"
    resp = await pool.post(a.url + "/", b"{}", {})
    assert await resp.read() == b"hello world"
    assert a.connections == 1  # chunked answers keep the connection
    for _ in range(2):
        resp = await pool.post(b.url + "/", b"{}", {})
        assert await resp.read() == b"all of it"
    assert b.connections == 2  # Connection: close is honoured
    pool.close()


async def test_idle_connection_closed_by_the_server_is_retried_once_fresh(serve):
    def one_per_connection(req: bytes, w: asyncio.StreamWriter) -> None:
        # Keep-alive promised, yet a second request on the connection finds it closed (the
        # server's idle timeout fired as the request left): no byte of an answer comes back.
        if w.served:  # type: ignore[attr-defined]
            w.close()
        else:
            fixed(b"ok")(req, w)

    server = await serve(one_per_connection)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    for _ in range(3):
        resp = await pool.post(server.url + "/", b"{}", {})
        assert await resp.read() == b"ok"
    assert server.connections == 3  # one per answered request: each stale one was retried fresh
    assert len(server.requests) == 5  # 3 answered, 2 that met a closing connection
    pool.close()


async def test_failures_raise_upstream_error_with_a_reason(serve):
    pool = UpstreamPool(connect_timeout=5, read_timeout=0.2)

    async def hang(_: bytes, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    def garbage(_: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"SMTP ready\r\n\r\n")

    def drop(_: bytes, w: asyncio.StreamWriter) -> None:
        w.close()

    def truncated(_: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        w.close()

    cases = {"timeout": hang, "bad response": garbage, "closed": drop}
    for why, reply in cases.items():
        server = await serve(reply)
        with pytest.raises(UpstreamError) as e:
            await pool.post(server.url + "/", b"{}", {})
        assert e.value.why.startswith(why)
    server = await serve(truncated)
    resp = await pool.post(server.url + "/", b"{}", {})
    with pytest.raises(UpstreamError, match="closed"):
        await resp.read()
    with pytest.raises(UpstreamError, match="connect"):
        await pool.post("http://127.0.0.1:1/", b"{}", {})
    assert not any(pool._idle.values())  # nothing broken went back to the pool
    pool.close()


async def test_on_sent_runs_once_even_when_the_request_is_retried(serve):
    server = await serve(fixed(b"ok"))
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    calls = []

    async def on_sent() -> None:
        calls.append(len(server.requests))

    await (await pool.post(server.url + "/", b"{}", {}, on_sent)).read()
    await (await pool.post(server.url + "/", b"{}", {}, on_sent)).read()
    assert calls == [0, 1]  # before the connect, then right after the pooled write
    pool.close()


async def test_a_slow_reader_pauses_the_socket(serve):
    big = b"x" * (8 * READ_AHEAD_BYTES)
    server = await serve(fixed(big))
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    resp = await pool.post(server.url + "/", b"{}", {})
    conn = resp._conn
    assert conn is not None
    while not conn.paused:  # each arriving body chunk wakes the waiter
        await conn.wait(5)
    assert conn.paused and conn.buffered <= 2 * READ_AHEAD_BYTES  # not the whole body
    assert await resp.read() == big
    pool.close()


async def test_bytes_sent_while_idle_are_never_taken_as_the_next_answer(serve):
    def answer_then_408(req: bytes, w: asyncio.StreamWriter) -> None:
        fixed(b"first")(req, w)
        w.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")

    server = await serve(answer_then_408)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    resp = await pool.post(server.url + "/", b"{}", {})
    assert await resp.read() == b"first"
    resp = await pool.post(server.url + "/", b"{}", {})
    assert resp.status == 200 and await resp.read() == b"first"
    pool.close()


async def test_header_bytes_pass_through_and_line_breaks_never_do(serve):
    server = await serve(fixed(b"ok"))
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    # What aiohttp's server hands over for the raw bytes "caf\xc3\xa9 \xff".
    headers = {"X-Name": "café \udcff", "X-Evil": "a\r\nX-Injected: 1"}
    await (await pool.post(server.url + "/", b"{}", headers)).read()
    sent = server.requests[0]
    assert b"\r\nX-Name: caf\xc3\xa9 \xff\r\n" in sent
    assert b"X-Injected" not in sent and b"X-Evil" not in sent
    pool.close()
