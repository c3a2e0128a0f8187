"""How a leg's bytes reach a replica: the exchange (router/routing/exchange.py) and the forwarder
(router/routing/forwarder.py) call ``Transport.send``; the transport reports back through
``Report``, the one narrow interface it sees of whoever drives the request.

    send(wire, report)          the request goes out (or is handed to whoever sends it)
      report.sent()             while the replica works on it (placement recorded)
      report.first_byte()       the replica's first bytes (a stream's: its prefill is done)
    -> (answer, Outcome)        relayed; or ``UpstreamUnavailable`` before the first byte

``Relay`` is today's transport: the gateway's own HTTP/1.1 client (router/upstream/client.py)
sends the request and ``proxy`` (router/upstream/proxy.py) streams the answer to the client. A
transport where another proxy sends the bytes and reports headers, first byte and usage back
(an Envoy ext_proc stream) implements the same ``send`` and feeds the same phases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from aiohttp import web

from router.upstream.client import UpstreamPool
from router.upstream.proxy import RETRYABLE_STATUS, Outcome, StreamErrorShape, proxy

Answer = TypeVar("Answer")
Answer_co = TypeVar("Answer_co", covariant=True)


class Report(Protocol):
    """What a transport tells the one driving the request, as it happens."""

    async def sent(self) -> None:
        """The request is on its way: runs once while the replica works on it."""

    def first_byte(self) -> None:
        """The replica's first bytes arrived (idempotent: a whole answer reports it too)."""


@dataclass(slots=True)
class Wire:
    """One leg's request as it goes out: where, what, and what the answer carries."""

    url: str  # the replica's URL and the endpoint's path
    body: bytes
    headers: Mapping[str, str]
    extra_headers: Mapping[str, str]  # added to the answer (the request id, decision headers)
    method: str = "POST"
    stream_error: StreamErrorShape = "openai"  # the API's shape for an error mid-stream
    headers_timeout: float | None = None  # the wait for response headers (None: the pool's)
    # Answers not relayed but retried (a decode leg's 500: its KV pull failed, vLLM's
    # kv_load_failure_policy "fail")
    retry_status: frozenset[int] = RETRYABLE_STATUS
    keep_answer: bool = False  # Outcome.answer: the whole answer (generated blocks)


class Transport(Protocol, Generic[Answer_co]):
    """Sends one leg and says how it went. Raises ``UpstreamUnavailable`` (router/upstream/proxy.py)
    when the replica could not take it, before the client saw a byte: retried elsewhere."""

    async def send(self, wire: Wire, report: Report) -> tuple[Answer_co, Outcome]: ...


class Relay:
    """The gateway relays the bytes itself: ``request``'s client gets the replica's answer."""

    __slots__ = ("pool", "request")

    def __init__(self, pool: UpstreamPool, request: web.Request) -> None:
        self.pool = pool
        self.request = request

    async def send(self, wire: Wire, report: Report) -> tuple[web.StreamResponse, Outcome]:
        resp, outcome = await proxy(
            self.pool,
            self.request,
            wire.url,
            wire.body,
            wire.headers,
            wire.extra_headers,
            on_first_byte=report.first_byte,
            on_sent=report.sent,
            stream_error=wire.stream_error,
            headers_timeout=wire.headers_timeout,
            method=wire.method,
            retry_status=wire.retry_status,
            keep_answer=wire.keep_answer,
        )
        report.first_byte()  # a whole (non-streamed) answer: its first byte came with the rest
        return resp, outcome
