"""Connection-level limits aiohttp does not have: a cap on open client connections, a
deadline for a request head (slowloris), and its own protocol errors in OpenAI's shape.

    GatewayRunner (an AppRunner) -> GatewayServer (counts connections) -> GatewayProtocol

- ``max_connections``: a connection opened beyond it has its first request answered with a
  503 ``overloaded`` and is closed (its head is read first: a response written before the
  client's request could be lost to a reset). ``GET /health`` and ``/ready`` are answered
  as usual on such a connection, then it is closed too: a full gateway is alive, and its
  probes must not restart it.
- ``header_timeout_s``: a connection must deliver a complete request head this soon after it
  opens, or after the first byte of a later request arrives. One that sent part of a head
  gets a 408; one that sent nothing is closed without an answer (there is no request to
  answer, and a pooling client could read an unsolicited answer as that of its next request).
- ``max_connections_per_peer``: one peer address (an IPv6 /64) holds at most this many of
  them (its share, ``client_share`` of the cap); a connection beyond it is answered like one
  beyond the cap, so one client cannot take every slot. Only ``peer_refusals_per_s`` of those
  are answered per peer (a token bucket); its other ones are closed as they are accepted,
  unread: a peer reconnecting in a loop (~3,000 connections/s from one process on loopback,
  each answered and closed) kept the event loop ~90% busy.
- ``keepalive_timeout_s``: an idle keep-alive connection is closed (aiohttp's own timer).
  Until a connection has carried a request whose tenant was identified (``mark_identified``:
  a valid key with auth on, any API request without), it gets
  ``unauthenticated_keepalive_s`` instead: probes and keyless clients do not hold slots.
- aiohttp's parser refusals (too many headers, a line too long, a bad request line, broken
  chunked framing) are answered as JSON errors, logged at debug, not as text with a traceback
  at error level (a client could fill the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.core.errors import APIError
from router.core.token_bucket import TokenBucket
from router.intake.budget import peer_key

log = logging.getLogger("prefix_router")

PROBE_PATHS = frozenset({"/health", "/ready"})  # answered even beyond max_connections


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 10_000
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    max_connections_per_peer: int = 10_000
    unauthenticated_keepalive_s: float = 75.0
    peer_refusals_per_s: float = 10.0


def raw_response(status: int, error: APIError) -> bytes:
    """A complete HTTP/1.1 response with the error's JSON body, closing the connection: for
    when the protocol answers outside aiohttp's request cycle (no request object exists)."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def parser_error(
    exc: BaseException | None, status: int, max_line: int = 8190, max_headers: int = 128
) -> APIError:
    """What aiohttp's parser refused, in the client's terms (no bytes of theirs echoed)."""
    too_large = "RequestHeaderFieldsTooLargeError"
    if isinstance(exc, http_exceptions.LineTooLong):
        return APIError(
            431,
            f"a request line or header is too long (at most {max_line} bytes each)",
            code="header_too_large",
            type_=too_large,
        )
    # The C parser raises a plain BadHttpMessage for these: its text says which.
    text = str(getattr(exc, "message", "") or "")
    if "Too many headers" in text:
        return APIError(
            431,
            f"too many request headers (at most {max_headers})",
            code="header_too_large",
            type_=too_large,
        )
    if "chunk" in text.lower() or isinstance(exc, http_exceptions.TransferEncodingError):
        return APIError(400, "invalid chunked transfer encoding", code="bad_framing")
    if isinstance(exc, http_exceptions.ContentLengthError):
        return APIError(400, "the body does not match its Content-Length", code="bad_framing")
    if isinstance(exc, (http_exceptions.BadStatusLine, http_exceptions.BadHttpMethod)):
        return APIError(400, "malformed HTTP request line", code="bad_request_line")
    if isinstance(exc, http_exceptions.InvalidHeader):
        return APIError(400, "malformed request header", code="bad_header")
    if status >= 500:
        return APIError(status, "internal error in the gateway", code="internal_error")
    return APIError(status if 400 <= status < 500 else 400, "malformed HTTP request")


class GatewayProtocol(RequestHandler):
    """aiohttp's connection handler with a request-head deadline, the connection cap and JSON
    protocol errors."""

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._on_refused = manager.on_refused
        self._counted = False
        self._shed = False  # closed as accepted: aiohttp never saw it
        self._peer = ""
        self._identified = False
        self._extended_to = -1.0  # the keep-alive deadline last lengthened for _identified
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # part of a head arrived since the timer was armed

    # -- connection cap -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        assert isinstance(server, GatewayServer)
        server.open_connections += 1
        self._counted = True
        peername = transport.get_extra_info("peername")
        self._peer = peer_key(peername[0] if isinstance(peername, tuple) and peername else None)
        held = server.peers[self._peer] = server.peers.get(self._peer, 0) + 1
        # A peer beyond its share first: at the cap too, its connections are its own excess.
        if held > self._limits.max_connections_per_peer:
            self._on_refused("peer_connections")
            if not server.may_answer(self._peer):
                self._shed = True
                transport.close()
                return
            self._request_handler = self._over_capacity(self._request_handler, per_peer=True)
        elif server.open_connections > self._limits.max_connections:
            self._on_refused("connections")
            self._request_handler = self._over_capacity(self._request_handler)
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            server = self._manager
            if isinstance(server, GatewayServer):
                server.open_connections -= 1
                left = server.peers.get(self._peer, 0) - 1
                if left > 0:
                    server.peers[self._peer] = left
                else:
                    server.peers.pop(self._peer, None)
                    server.refusals.pop(self._peer, None)
        if self._shed:
            return
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _over_capacity(self, handler: Any, per_peer: bool = False) -> Any:
        if per_peer:
            message = (
                f"this client has {self._limits.max_connections_per_peer} connections open to "
                "the gateway, its share; retry shortly (reuse connections, or open fewer)"
            )
        else:
            message = (
                f"the gateway has {self._limits.max_connections} client connections open, its "
                "limit; retry shortly (reuse connections, or send fewer at once)"
            )

        async def answer(request: BaseRequest) -> web.StreamResponse:
            if request.method in ("GET", "HEAD") and request.path in PROBE_PATHS:
                resp: web.StreamResponse = await handler(request)
            else:
                resp = APIError(503, message, code="overloaded").response({"Retry-After": "1"})
            resp.force_close()
            return resp

        return answer

    # -- keep-alive: short until a request was identified ---------------------------------
    def mark_identified(self) -> None:
        self._identified = True

    def _process_keepalive(self) -> None:
        # aiohttp arms the keep-alive timer with the short timeout this connection was made
        # with; an identified one gets the long one, counted from the same last response.
        if self._identified and self._next_keepalive_close_time != self._extended_to:
            limits = self._limits
            extra = limits.keepalive_timeout_s - min(
                limits.unauthenticated_keepalive_s, limits.keepalive_timeout_s
            )
            self._next_keepalive_close_time += extra
            self._extended_to = self._next_keepalive_close_time
        super()._process_keepalive()

    # -- request-head deadline ------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = False
        self._head_timer = self._loop.call_later(
            self._limits.header_timeout_s, self._head_timed_out
        )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        if self._shed:
            return
        waiting = self._waiter is not None and not self._waiter.done() and not self._messages
        if data and waiting and self._head_timer is None:
            self._arm_head_timer()  # the first byte of a keep-alive connection's next request
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._cancel_head_timer()  # a complete head (the body has its own deadline)
        elif data and self._head_timer is not None:
            self._head_bytes = True

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or self._force_close or self._messages:
            return
        if self._request_in_progress or (self._waiter is None and self._request_count):
            return  # a request is being handled (or answered): not waiting for a head
        self._on_refused("header_timeout")
        if self._head_bytes:
            error = APIError(
                408,
                f"the request head did not arrive within {self._limits.header_timeout_s:g} s",
                code="header_timeout",
            )
            transport.write(raw_response(408, error))
        self.force_close()

    # -- parser errors --------------------------------------------------------------------
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a handler's error that escaped the app's middleware
            log.error("request from %s failed: %s: %.200s", request.remote, type(exc).__name__, exc)
        else:
            log.debug("refused a malformed request from %s: %r", request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        resp = parser_error(exc, status, self.max_field_size, self.max_headers).response()
        resp.force_close()
        return resp


def mark_identified(request: web.BaseRequest) -> None:
    """The request's tenant was identified: its connection keeps the long keep-alive."""
    protocol = request.protocol
    if isinstance(protocol, GatewayProtocol):
        protocol.mark_identified()


class GatewayServer(web.Server):
    """aiohttp's server, making ``GatewayProtocol`` connections and counting them."""

    def __init__(
        self,
        *args: Any,
        limits: ConnectionLimits,
        on_refused: Callable[[str], None] = lambda reason: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.on_refused = on_refused
        self.open_connections = 0
        self.peers: dict[str, int] = {}  # open connections per peer (router/intake/budget.py's key)
        # Per peer over its share: its answered-refusals bucket.
        self.refusals: dict[str, TokenBucket] = {}

    def may_answer(self, peer: str) -> bool:
        """Whether a connection from ``peer`` beyond its share may be answered (a token of
        the peer's bucket: ``peer_refusals_per_s``, as many at once)."""
        bucket = self.refusals.get(peer)
        if bucket is None:
            rate = self.limits.peer_refusals_per_s
            bucket = self.refusals[peer] = TokenBucket(max(rate, 1.0), rate)
        return bucket.try_take(1.0, self._loop.time())

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose server is a ``GatewayServer``."""

    def __init__(
        self,
        app: web.Application,
        limits: ConnectionLimits,
        on_refused: Callable[[str], None] = lambda reason: None,
        **kwargs: Any,
    ) -> None:
        # Every connection starts with the short keep-alive; identified ones are lengthened.
        kwargs.setdefault(
            "keepalive_timeout",
            min(limits.keepalive_timeout_s, limits.unauthenticated_keepalive_s),
        )
        super().__init__(app, **kwargs)
        self._limits = limits
        self._on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup runs here
        return GatewayServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            limits=self._limits,
            on_refused=self._on_refused,
            **server._kwargs,
        )
