"""A lean HTTP/1.1 client for the proxy path: keep-alive connections per replica, one socket
write per request, responses parsed by llhttp (``httptools``).

Why not aiohttp's ClientSession: per request it builds request and response objects, runs
tracing hooks, a cookie jar and auto headers, about 0.2 ms of CPU that showed up as a sixth of
the gateway's profile. The gateway sends one kind of request (a POST of bytes it already has)
and relays bytes back, so that is all this does. Health checks and metric scrapes keep aiohttp.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

# A streamed body is read ahead at most this far before the socket is paused (back-pressure
# from a slow client reaches the replica instead of filling our memory).
READ_AHEAD_BYTES = 1 << 20
MAX_IDLE_PER_ORIGIN = 256
MAX_INTERIM_RESPONSES = 16  # 1xx answers skipped before one request's final response
# A response head larger than this is a broken or hostile replica, not relayed (a 200 KB
# header went to the client whole).
MAX_HEAD_BYTES = 64 * 1024
# Request ids sent on one connection that are remembered: an answer naming one of them is a
# crossed (late) answer; an id never sent on it is a hop that sets its own ids.
SENT_IDS_KEPT = 32


class UpstreamError(Exception):
    """The round trip failed: ``why`` names how (connect, closed, timeout, bad response)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one round trip at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.sent_ids: deque[str] = deque(maxlen=SENT_IDS_KEPT)  # kept across round trips
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head_bytes = 0
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.got_bytes = False
        self.headers_done = False
        self.message_done = False
        self.keep_alive = False
        self.stray = False
        self.interim = False  # parsing a 1xx answer: not the response, skip it
        self.interim_seen = 0
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._fail(UpstreamError(f"bad response: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.message_done and self.error is None:
            if self.headers_done and self._ends_at_close():
                self.on_message_complete()
            else:
                self._fail(UpstreamError("closed" if exc is None else type(exc).__name__))

    # -- httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.message_done:  # a second answer to one request (a 408 while idle, say)
            self.stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.stray or self.error is not None:
            return
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            self._fail(UpstreamError(f"bad response: headers over {MAX_HEAD_BYTES} bytes"))
            self.abort()
            return
        self.headers.append((name.decode("latin-1"), value.decode("utf-8", "replace")))

    def on_headers_complete(self) -> None:
        if self.stray or self.error is not None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints: interim, the final answer follows on this
            # connection. Taking one as the answer left the real one for the next request.
            # 101 would switch protocols, which a proxied POST never asked for.
            self.interim_seen += 1
            if status == 101 or self.interim_seen > MAX_INTERIM_RESPONSES:
                self._fail(UpstreamError(f"bad response: unexpected HTTP {status}"))
                self.abort()
                return
            self.interim = True
            self.headers.clear()
            self.head_bytes = 0
            return
        self.status = status
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.stray:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_AHEAD_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.stray:
            return
        if self.interim:  # llhttp ends a 1xx as a message of its own; the response is next
            self.interim = False
            return
        self.message_done = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self._wake()

    # -- the consumer's side ----------------------------------------------------------------
    def _ends_at_close(self) -> bool:
        """A body with neither a length nor chunked encoding ends when the connection does."""
        names = {k.lower() for k, _ in self.headers}
        return "content-length" not in names and "transfer-encoding" not in names

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until the parser has something new (headers, body, end, an error)."""
        self.waiter = w = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._timed_out, w) if timeout is not None else None
        try:
            await w
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, w: asyncio.Future[None]) -> None:
        if not w.done():
            self._fail(UpstreamError("timeout"))
            self.abort()

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """Status and headers of an upstream answer; the body is read with ``read`` or
    ``iter_chunks``. ``release`` (or a complete read) hands the connection back for reuse;
    ``close`` drops it, which makes vLLM abort the request."""

    def __init__(self, pool: UpstreamPool, origin: str, conn: _Connection, timeout: float | None):
        self._pool = pool
        self._origin = origin
        self._conn: _Connection | None = conn
        self._timeout = timeout
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: str, default: str = "") -> str:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_chunks()]
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.error is not None:
                self.close()
                raise conn.error
            if conn.message_done:
                self.release()
                return
            await conn.wait(self._timeout)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put_back(self._origin, conn)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class UpstreamPool:
    """Keep-alive connections per origin (``scheme://host:port``)."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float | None,
        keepalive_s: float = 60.0,
        on_rewritten_id: Callable[[str], None] | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        # Called with the origin for each answer whose X-Request-Id the gateway never sent
        # on that connection (an intermediary that sets its own ids): accepted, counted.
        self.on_rewritten_id = on_rewritten_id
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self._idle: dict[str, list[_Connection]] = {}
        self._origins: dict[str, tuple[str, int, ssl.SSLContext | None, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], Awaitable[None]] | None = None,
        *,
        timeout: float | None = None,
        method: str = "POST",
    ) -> Response:
        """Send the request (``method``, ``body`` even if empty: a ``Content-Length: 0`` on a
        GET is valid HTTP/1.1); return once the response headers are in. Raises
        ``UpstreamError`` if no response started (always safe to retry elsewhere).
        ``timeout`` bounds the wait for headers (default ``read_timeout``).

        ``on_sent`` runs once, while the replica works: right after the request is written
        to a pooled connection, or before a new connection's connect (so that nothing else
        runs on the event loop between the caller's last step and ``on_sent``)."""
        origin, path = _split(url)
        host, port, sslctx, host_header = self._origin(origin)
        head = [
            method.encode("ascii"),
            b" ",
            path.encode("ascii"),
            b" HTTP/1.1\r\nHost: ",
            host_header,
        ]
        for k, v in headers.items():
            if "\n" in v or "\r" in v:  # never let a value (say, a configured key) split lines
                continue
            # aiohttp hands header text over as UTF-8 with surrogateescape: the client's bytes.
            head += (b"\r\n", _wire(k), b": ", _wire(v))
        head += (b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n\r\n")
        request = b"".join(head)
        expected = _request_id(headers)
        loop = asyncio.get_running_loop()
        fresh_only = False
        while True:
            conn, reused = None if fresh_only else self._take_idle(origin, loop), True
            if conn is None:
                if on_sent is not None:
                    await on_sent()
                    on_sent = None
                conn, reused = await self._connect(loop, host, port, sslctx), False
            assert conn.transport is not None
            if len(body) < 65536:  # one write; a large body is not copied to join it
                conn.transport.write(request + body)
            else:
                conn.transport.writelines((request, body))
            if on_sent is not None:
                await on_sent()
                on_sent = None
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(self.read_timeout if timeout is None else timeout)
            except UpstreamError:
                conn.abort()
                if reused and not conn.got_bytes and conn.error and conn.error.why != "timeout":
                    continue  # the replica had closed this idle connection: one fresh try
                raise
            except BaseException:
                conn.abort()
                raise
            echoed = next((v for k, v in conn.headers if k.lower() == "x-request-id"), None)
            if expected is not None and echoed is not None and echoed != expected:
                if echoed in conn.sent_ids:
                    # The answer to an earlier request on this connection (a late one):
                    # never anyone's. vLLM echoes X-Request-Id (with
                    # --enable-request-id-headers); one fresh connection, then give up.
                    conn.abort()
                    if reused and not fresh_only:
                        fresh_only = True
                        continue
                    raise UpstreamError("bad response: X-Request-Id is another request's")
                # An id never sent on this connection: a hop in between (a proxy, a mesh
                # sidecar) sets its own. Refusing it failed every request through that hop;
                # stale bytes are still caught before the write (got_bytes, _unread).
                if self.on_rewritten_id is not None:
                    self.on_rewritten_id(origin)
            if expected is not None:
                conn.sent_ids.append(expected)
            return Response(self, origin, conn, self.read_timeout)

    def _origin(self, origin: str) -> tuple[str, int, ssl.SSLContext | None, bytes]:
        found = self._origins.get(origin)
        if found is None:
            parts = urlsplit(origin)
            https = parts.scheme == "https"
            host = parts.hostname or "localhost"
            port = parts.port or (443 if https else 80)
            if https and self._ssl is None:
                self._ssl = ssl.create_default_context()
            found = (host, port, self._ssl if https else None, parts.netloc.encode("idna"))
            self._origins[origin] = found
        return found

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, sslctx: ssl.SSLContext | None
    ) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), host, port, ssl=sslctx),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect timeout") from None
        except OSError as e:
            raise UpstreamError(f"connect: {type(e).__name__}") from None
        return conn

    def _take_idle(self, origin: str, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            conn = idle.pop()
            # Bytes that arrived while idle (a 408, say) belong to no request of ours, whether
            # the loop has read them yet or they still wait in the socket.
            if (
                not conn.closed
                and not conn.got_bytes
                and now - conn.idle_since < self.keepalive_s
                and not _unread(conn)
            ):
                return conn
            conn.abort()
        return None

    def _put_back(self, origin: str, conn: _Connection) -> None:
        if conn.closed or not conn.message_done or not conn.keep_alive or conn.stray:
            conn.abort()
            return
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            conn.abort()
            return
        conn._reset()
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def _request_id(headers: Mapping[str, str]) -> str | None:
    for k, v in headers.items():
        if k.lower() == "x-request-id":
            return v
    return None


def _unread(conn: _Connection) -> bool:
    """Whether an idle plain-TCP connection has bytes (or an EOF) the loop has not read yet
    (TLS has records of its own between requests; the X-Request-Id check covers it)."""
    transport = conn.transport
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _wire(text: str) -> bytes:
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoder produced: keep the request going
        return text.encode("utf-8", "replace")


def _split(url: str) -> tuple[str, str]:
    """``http://h:p/path?q`` -> (``http://h:p``, ``/path?q``)."""
    scheme_end = url.index("://") + 3
    slash = url.find("/", scheme_end)
    if slash < 0:
        return url, "/"
    return url[:slash], url[slash:]
