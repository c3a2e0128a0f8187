"""Upstream I/O: send one request to one replica and pass its answer through untouched.

Nothing here decides where a request goes; the caller hands in the replica. What happens
before the first response byte can be retried elsewhere (``UpstreamUnavailable``); after it,
the bytes go to the client as they come, and a failure just ends the response.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.upstream.client import UpstreamError, UpstreamPool

# Response headers the gateway never relays (it frames the answer to its client itself).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
    }
)
# Request headers that are about the client's connection to the gateway, or that the gateway
# owns, never the replica's business. Expect above all: the replica's interim 100 Continue
# once desynchronised a pooled connection. Content-Encoding: the body is forwarded decoded
# (router/intake/body.py). Accept-Encoding: the gateway reads the answer (usage, cached tokens), so
# the replica must answer uncompressed; vLLM does not compress anyway.
REQUEST_CONTROL = frozenset(
    {
        "expect",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "content-type",  # set to application/json below
        "accept-encoding",
        "authorization",  # replaced or passed on explicitly below
        "x-request-id",  # set below
    }
)
# With auth on, only these client headers reach a replica (plus ``forward_headers``): the
# request's media negotiation, tracing, and the API-version headers SDKs send. Never
# X-Forwarded-For, a tenant header or anything else a tenant could use to pose as another.
AUTH_ALLOWED = frozenset(
    {
        "accept",
        "user-agent",
        "traceparent",
        "tracestate",
        "baggage",
        "openai-beta",
        "openai-version",
        "anthropic-version",
        "anthropic-beta",
    }
)
RETRYABLE_STATUS = frozenset({502, 503})


# A replica that closed the connection before answering (router/upstream/client.py's reasons): it is
# gone or going, and vLLM aborts a request whose connection closes, so a re-send is failover,
# not a second computation of the same request.
DROPPED = frozenset({"closed", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError"})


class UpstreamUnavailable(Exception):
    """The replica could not take the request (connect error, 502/503, timeout before any
    byte): safe to retry on another replica. ``counts``: the replica's failure is recorded
    (False when another request already recorded this one, e.g. a shared adapter load).
    ``sent``: the replica may still compute the request (it reached it and the connection
    was not dropped: a timeout, an answer refusing it), so a re-send may have it computed
    twice and takes the retry budget. ``went``: the replica that took the request instead,
    when another proxy sends the bytes and already went on to the next endpoint (Envoy
    walking an endpoint picker's fallbacks): the request can only be booked there."""

    def __init__(
        self, why: str, counts: bool = True, sent: bool | None = None, went: str | None = None
    ) -> None:
        super().__init__(why)
        self.why = why
        self.counts = counts
        if sent is None:
            sent = not (why.startswith("connect") or why in DROPPED)
        self.sent = sent
        self.went = went


@dataclass(slots=True)
class Outcome:
    status: int
    first_byte_s: float
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when reported
    completion_tokens: int | None
    complete: bool  # the whole upstream body reached the client
    head: bytes = b""  # the answer's first bytes (at most HEAD_BYTES), for observers
    # The whole answer when the caller asked for it (keep_answer: generated blocks,
    # router/routing/generated.py); the stream's chunks as relayed, joined after its end.
    answer: bytes = b""


def header_allow_list(auth: bool, forward_headers: Sequence[str]) -> frozenset[str] | None:
    """Client headers a replica may see: ``None`` forwards all but the control headers (auth
    off and no ``forward_headers``, the historical behaviour)."""
    named = frozenset(h.strip().lower() for h in forward_headers if h.strip())
    if not auth and not named:
        return None
    return (AUTH_ALLOWED | named) - REQUEST_CONTROL


def request_headers(
    incoming: Mapping[str, str],
    request_id: str,
    upstream_api_key: str | None,
    forward_authorization: bool,
    allow: frozenset[str] | None = None,
) -> CIMultiDict[str]:
    # Headers the client's Connection header names are hop-by-hop as well (RFC 9110 7.6.1).
    dropped = {t.strip().lower() for t in incoming.get("Connection", "").split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in incoming.items():
        lk = k.lower()
        if allow is not None and lk not in allow:
            continue
        if lk in REQUEST_CONTROL or lk in dropped or lk.startswith(("proxy-", "x-prefix-router-")):
            continue
        out.add(k, v)
    if upstream_api_key:
        out["Authorization"] = f"Bearer {upstream_api_key}"
    elif forward_authorization and "Authorization" in incoming:
        out["Authorization"] = incoming["Authorization"]
    out["X-Request-Id"] = request_id
    out["Content-Type"] = "application/json"
    return out


def _response_headers(
    upstream: Sequence[tuple[str, str]], extra: Mapping[str, str]
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream:
        if k.lower() not in HOP_BY_HOP and k.lower() != "x-request-id":
            out.add(k, v)
    out.update(extra)
    return out


# The last ``"usage":`` key in a body or an SSE tail (not one inside a JSON string, which
# would be ``\\"usage\\"``): every API puts its final usage last (chat's last chunk,
# Anthropic's message_delta, Responses' response.completed, whose event may be longer than
# the tail kept, so the object is decoded from the key on, not from the event's start).
# Found last first with ``rfind`` (a regex scan of the whole body cost ~10 us a response).
_AFTER_KEY = re.compile(rb"\s*:\s*")
_DECODER = json.JSONDecoder()
HEAD_BYTES = 4096  # the start of an answer kept for observers (a Responses id)


def usage_of(body: bytes) -> tuple[int | None, int | None]:
    """(cached_tokens, completion_tokens) from a JSON body or an SSE tail, if reported.

    Cached tokens as each API reports them: chat/completions
    ``prompt_tokens_details.cached_tokens``, Responses ``input_tokens_details.cached_tokens``,
    Anthropic ``cache_read_input_tokens``."""
    end = len(body)
    while (at := body.rfind(b'"usage"', 0, end)) >= 0:
        end = at
        after = _AFTER_KEY.match(body, at + 7)
        if after is None or (at > 0 and body[at - 1] == 0x5C):  # a backslash before it
            continue
        try:
            usage, _ = _DECODER.raw_decode(body[after.end() :].decode("utf-8", "replace"))
        except ValueError:
            continue
        if not isinstance(usage, dict):
            continue
        cached: object = None
        for key in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(key)
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                cached = details.get("cached_tokens")
                break
        if cached is None:
            cached = usage.get("cache_read_input_tokens")
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        return _count(cached), _count(completion)
    return None, None


def _count(value: object) -> int | None:
    """A token count a replica reported, if it is one (never a bool, a float or a number
    past 2**53, which metrics and estimates cannot hold)."""
    return value if type(value) is int and 0 <= value <= 2**53 else None


StreamErrorShape = Literal["openai", "anthropic"]
STREAM_CUT_MESSAGE = "upstream replica closed the stream before it finished"
# The API each endpoint speaks, for errors told mid-stream.
STREAM_ERROR_SHAPES: dict[str, StreamErrorShape] = {
    "chat": "openai",
    "completions": "openai",
    "responses": "openai",
    "messages": "anthropic",
}


def stream_error_event(shape: StreamErrorShape, message: str = STREAM_CUT_MESSAGE) -> bytes:
    """One SSE error event as the endpoint's API sends it mid-stream."""
    if shape == "anthropic":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    err = {"message": message, "type": "server_error", "code": "upstream_stream_cut"}
    return b"data: " + json.dumps({"error": err}).encode() + b"\n\n"


async def _end_cut_stream(
    request: web.Request, stream: web.StreamResponse, tail: bytes, shape: StreamErrorShape
) -> None:
    """Say in-band that the stream broke, then drop the client's connection before the
    chunked terminator: a clean end would pass a truncated answer off as complete."""
    # Finish a half-written event first, so the error event parses as one of its own.
    sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n" if tail.endswith(b"\n") else b"\n\n"
    await stream.write(sep + stream_error_event(shape))
    # Closing (not aborting) flushes the event; aiohttp's own end of the response then
    # finds the transport gone and writes no terminator.
    request.protocol.force_close()


async def proxy(
    pool: UpstreamPool,
    request: web.Request,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    extra_headers: Mapping[str, str],
    on_first_byte: Callable[[], None] | None = None,
    on_sent: Callable[[], Awaitable[None]] | None = None,
    stream_error: StreamErrorShape = "openai",
    headers_timeout: float | None = None,
    method: str = "POST",
    retry_status: frozenset[int] = RETRYABLE_STATUS,
    keep_answer: bool = False,
) -> tuple[web.StreamResponse, Outcome]:
    """Send ``body`` to ``url`` (``method``, POST by default) and relay the answer to ``request``'s client.

    ``on_sent`` runs while the replica works (``UpstreamPool.post``); ``on_first_byte`` when
    its first body bytes arrive (for a stream, the end of its prefill). Raises
    ``UpstreamUnavailable`` only before anything reached the client. A stream the replica
    cuts ends with one error event in ``stream_error``'s shape and a truncated body.
    ``headers_timeout`` bounds the wait for response headers (default: the pool's).
    ``retry_status``: the answers that are ``UpstreamUnavailable`` rather than relayed."""
    start = time.perf_counter()
    try:
        upstream = await pool.post(
            url, body, headers, on_sent, timeout=headers_timeout, method=method
        )
    except UpstreamError as e:
        raise UpstreamUnavailable(e.why) from e
    try:
        if upstream.status in retry_status:
            raise UpstreamUnavailable(f"HTTP {upstream.status}")
        out_headers = _response_headers(upstream.headers, extra_headers)
        if "text/event-stream" not in upstream.header("content-type"):
            try:
                data = await upstream.read()
            except UpstreamError as e:
                raise UpstreamUnavailable(e.why) from e
            first = time.perf_counter() - start
            cached, completion = usage_of(data) if upstream.status == 200 else (None, None)
            resp = web.Response(status=upstream.status, body=data, headers=out_headers)
            outcome = Outcome(upstream.status, first, cached, completion, True, data[:HEAD_BYTES])
            if keep_answer:
                outcome.answer = data
            return resp, outcome

        # Streaming: relay chunk by chunk; the response is committed at the first chunk.
        chunks = upstream.iter_chunks()
        try:
            first_chunk = await chunks.__anext__()
        except StopAsyncIteration:
            first_chunk = b""
        except UpstreamError as e:
            raise UpstreamUnavailable(e.why) from e
        first = time.perf_counter() - start
        if on_first_byte is not None:
            on_first_byte()
        stream = web.StreamResponse(status=upstream.status, headers=out_headers)
        await stream.prepare(request)
        tail = first_chunk[-16384:]
        kept: list[bytes] | None = [first_chunk] if keep_answer else None
        complete = False
        try:
            if first_chunk:
                await stream.write(first_chunk)
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    complete = True
                    break
                except UpstreamError:
                    break
                await stream.write(chunk)
                tail = (tail + chunk)[-16384:]
                if kept is not None:
                    kept.append(chunk)
            if complete:
                await stream.write_eof()
            else:
                await _end_cut_stream(request, stream, tail, stream_error)
        except (aiohttp.ClientError, ConnectionResetError, OSError):
            pass  # the client left: nobody to tell
        if not complete:
            upstream.close()  # drop the connection so the engine aborts the request
        cached, completion = usage_of(tail) if upstream.status == 200 else (None, None)
        head = first_chunk[:HEAD_BYTES]
        outcome = Outcome(upstream.status, first, cached, completion, complete, head)
        if kept is not None and complete:
            outcome.answer = b"".join(kept)
        return stream, outcome
    except BaseException:
        upstream.close()  # cancelled (client gone) or failed: never reuse a half-read socket
        raise
    finally:
        upstream.release()  # a no-op unless the body was read to its end
