"""The ext_proc stream as the exchange's transport (router/upstream/transport.py): Envoy sends the
bytes, the picker tells it where and hears back how it went.

    send(wire, report)   the pick (primary and fallbacks) and the request body to Envoy;
                         ``report.sent()``; then Envoy's response phase: the endpoint it
                         reached, the status, each body chunk passed back as it comes
                         (``report.first_byte()`` at a stream's first), usage at the end
    -> (None, Outcome)   the same outcome the HTTP relay returns, so learning, drift watch,
                         health and flow control read it unchanged

Envoy walks the fallbacks itself when the primary refuses the connection; the response
headers then name the endpoint that served. The transport says so the way any transport
says a replica could not take a leg, ``UpstreamUnavailable`` (not sent, counted against the
refusing replica), naming where the request went instead (``went``): the exchange takes the
refused replica's blocks back and plans the request again on that replica, whose leg this
transport then reports from the response already under way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from multidict import CIMultiDict

from router.ext_proc import protocol
from router.ext_proc.conversation import Conversation
from router.upstream.proxy import HEAD_BYTES, Outcome, UpstreamUnavailable, usage_of
from router.upstream.transport import Report, Wire

TAIL_BYTES = 16_384  # a stream's end kept for its usage, as the relay keeps it
# Client headers the picker never asks Envoy to remove: Envoy's own (pseudo-headers, the
# host, framing, its x-envoy-* headers), which its mutation rules refuse to touch anyway.
KEPT = frozenset({"host", "content-length", "transfer-encoding", "connection", "te", "upgrade"})


def endpoint_of(url: str) -> str:
    """A replica's endpoint as the pool names it: ``host:port`` of its URL."""
    return urlsplit(url).netloc


def request_mutation(
    client: Mapping[str, str], upstream: Mapping[str, str], extra: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """What Envoy must change in the client's headers so the replica sees ``upstream`` (the
    headers the relay would send, router/upstream/proxy.py ``request_headers``), plus ``extra``:
    (headers to set, headers to remove)."""
    wanted = CIMultiDict(upstream)
    set_ = {k: v for k, v in wanted.items() if client.get(k) != v}
    set_.update(extra)
    kept = KEPT.union(e.lower() for e in extra)
    remove = set()
    for k in client:
        key = k.lower()
        if key not in wanted and key not in kept and not key.startswith((":", "x-envoy-")):
            remove.add(key)
    return set_, sorted(remove)


class EnvoyLeg:
    """One ext_proc stream's request, handed to Envoy (``Transport[None]``)."""

    def __init__(
        self,
        conversation: Conversation,
        modes: tuple[int, int],
        client_headers: Mapping[str, str],
        client_body: bytes,
        fallbacks: Callable[[str], list[str]],
        replica_at: Callable[[str], str | None],
    ) -> None:
        self.conv = conversation
        self.request_mode, self.response_mode = modes
        self.client_headers = client_headers
        self.client_body = client_body
        self.fallbacks = fallbacks  # a replica URL -> the replicas Envoy may try after it
        self.replica_at = replica_at  # an endpoint -> its replica's URL (None: not ours)
        self.picked = False
        self.served: str | None = None  # the endpoint whose response is under way
        self.status = 0
        self.streaming = False
        self.started = 0.0

    async def send(self, wire: Wire, report: Report) -> tuple[None, Outcome]:
        endpoint = endpoint_of(wire.url)
        if not self.picked:
            self.started = time.perf_counter()
            self.picked = True
            # The placement is recorded before the pick is written: writing yields to the
            # loop, and a request decided meanwhile must see where this one went (as the relay
            # records it before anything else runs once its request is on the wire).
            await report.sent()
            await self._pick(wire, endpoint)
            await self._response_headers()
            if self.served is None:  # an Envoy that does not say: where it was told to go
                self.served = endpoint
        else:
            await report.sent()  # the request already on its way to this replica
        if self.served != endpoint:
            raise UpstreamUnavailable(
                f"connect: Envoy could not reach {endpoint} and went on to {self.served}",
                sent=False,
                went=self.replica_at(self.served or ""),
            )
        await self.conv.write(protocol.response_headers_response(wire.extra_headers))
        return None, await self._response_body(report)

    async def _pick(self, wire: Wire, endpoint: str) -> None:
        """The destination, primary first, and the body as the replica must get it."""
        primary = wire.url[: len(wire.url) - len(urlsplit(wire.url).path)]
        endpoints = ",".join([endpoint] + [endpoint_of(u) for u in self.fallbacks(primary)])
        changed = wire.body != self.client_body
        set_, remove = request_mutation(
            self.client_headers, wire.headers, {protocol.DESTINATION: endpoints}
        )
        if changed and self.request_mode == protocol.BUFFERED:
            set_["content-length"] = str(len(wire.body))
        headers = protocol.mutation(set_, remove)
        metadata = protocol.pick_metadata(endpoints)
        if self.request_mode == protocol.BUFFERED:
            body = wire.body if changed else None
            await self.conv.write(protocol.buffered_body_response(headers, metadata, body))
            return
        # Full duplex: the pick answers the headers, then the body goes back whole (Envoy
        # forwards what the picker sends, changed or not), in chunks, the last one ending it.
        await self.conv.write(protocol.request_headers_response(headers, metadata))
        for chunk in protocol.streamed_chunks(wire.body, end=True):
            await self.conv.write(chunk)

    async def _next(self) -> protocol.ProcessingRequest:
        msg = await self.conv.read()
        if msg is None:
            # Envoy ended the stream before the response did: its client went away (or
            # Envoy gave up on the request), as a client's disconnect is on the relay path.
            raise asyncio.CancelledError
        return msg

    async def _response_headers(self) -> None:
        while True:
            msg = await self._next()
            if msg.HasField("request_trailers"):
                await self.conv.write(protocol.trailers_response(response=False))
                continue
            if msg.HasField("response_headers"):
                break
        headers = protocol.header_map(msg.response_headers)
        self.served = protocol.served_endpoint(msg)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.streaming = "text/event-stream" in headers.get("content-type", "")
        if msg.response_headers.end_of_stream:
            self.ended_at_headers = True
        else:
            self.ended_at_headers = False

    async def _response_body(self, report: Report) -> Outcome:
        """Each chunk back to Envoy as it comes; the usage from the end of it."""
        first_s: float | None = None
        kept = bytearray()
        head = b""
        complete = self.ended_at_headers
        duplex = self.response_mode == protocol.FULL_DUPLEX
        while not complete:
            msg = await self._next()
            if msg.HasField("response_trailers"):
                await self.conv.write(protocol.trailers_response(response=True))
                complete = True
                break
            if not msg.HasField("response_body"):
                continue
            chunk, end = msg.response_body.body, msg.response_body.end_of_stream
            if first_s is None and (chunk or end):
                first_s = time.perf_counter() - self.started
                head = bytes(chunk[:HEAD_BYTES])
                if self.streaming:
                    report.first_byte()  # a stream's first bytes: its prefill is done
            kept += chunk
            if self.streaming and len(kept) > TAIL_BYTES:
                del kept[:-TAIL_BYTES]
            if duplex:
                for answer in protocol.streamed_chunks(chunk, end, response=True):
                    await self.conv.write(answer)
            else:
                await self.conv.write(protocol.response_body_response())
            complete = end
        if first_s is None:
            first_s = time.perf_counter() - self.started
        cached, completion = usage_of(bytes(kept)) if self.status == 200 else (None, None)
        return Outcome(self.status, first_s, cached, completion, complete, head)
