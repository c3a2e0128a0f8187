"""The endpoint picker: one Envoy ext_proc ``Process`` stream per HTTP request, driving the
same exchange (router/routing/exchange.py) as the HTTP front end, over the ext_proc transport.

    request headers     the tenant (the same headers as proxy mode), the endpoint by path;
                        buffered mode: "go on" at once, so Envoy sends the body
    request body        gathered until its end (bounded as the HTTP front end bounds it),
                        then prepared (parsed, rendered, salted, hashed) as in proxy mode
    the exchange        admit, plan, each leg through ``EnvoyLeg`` (the pick, the body, the
                        response phase), learn, close
    refusals            an ``ImmediateResponse`` with the status and the API's error body
                        (401, 413, 429 from flow control, 503 when no endpoint can take it)

A request without a body or on a path the gateway does not route (``GET /v1/models``) goes
to the least-loaded healthy replica, and the stream ends once routed: Envoy relays the rest
unwatched, as llm-d's picker does for bodiless requests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from multidict import CIMultiDict

from router.api import anthropic
from router.core.errors import APIError
from router.disagg.roles import in_pool
from router.ext_proc import protocol
from router.ext_proc.conversation import Conversation
from router.ext_proc.transport import EnvoyLeg, endpoint_of, request_mutation
from router.gateway import Gateway
from router.intake.budget import peer_key
from router.intake.routed_request import Endpoint, RoutedRequest
from router.routing.exchange import Exchange
from router.upstream.proxy import request_headers

log = logging.getLogger("prefix_router")

ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
CODINGS = ("", "identity", "gzip", "x-gzip", "deflate")


def _request_id(headers: Mapping[str, str]) -> str:
    given = headers.get("x-request-id", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return os.urandom(12).hex()


def _coding(headers: Mapping[str, str]) -> str:
    """The body's content coding, once its type was checked (router/intake/body.py's rules)."""
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {media[:100]!r}",
            code="unsupported_media_type",
        )
    coding = headers.get("content-encoding", "").strip().lower()
    if coding not in CODINGS:
        raise APIError(
            415,
            f"Content-Encoding {coding[:50]!r} is not supported; send the body as is, "
            "gzip or deflate",
            code="unsupported_content_encoding",
        )
    return "" if coding == "identity" else coding


class Picker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service of one gateway."""

    def __init__(
        self,
        gateway: Gateway,
        default_mode: int = protocol.FULL_DUPLEX,
        responses: Callable[[RoutedRequest, str], Awaitable[RoutedRequest]] | None = None,
    ) -> None:
        self.gw = gateway
        self.default_mode = default_mode  # when Envoy does not say (no protocol_config)
        # A Responses body: pinned to the replica holding its previous_response_id, as the
        # HTTP front end pins it (router/api/routes.py ``pin_stored``).
        self.responses = responses

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        conv = Conversation(context)
        first = await conv.read()
        if first is None or not first.HasField("request_headers"):
            return
        headers = protocol.header_map(first.request_headers)
        endpoint = ENDPOINTS.get(headers.get(":path", "").split("?", 1)[0])
        request_id = _request_id(headers)
        try:
            if first.request_headers.end_of_stream or endpoint is None:
                await self.unrouted(conv, first, headers, request_id)
                return
            await self.routed(conv, first, headers, endpoint, request_id)
        except APIError as e:
            self.gw.metrics.ext_proc_refusals.labels(str(e.status)).inc()
            if e.status >= 500:
                log.info("request %s: refused to Envoy with %d: %s", request_id, e.status, e)
            await conv.write(self.refusal(e, endpoint, request_id))
        except Exception as e:
            # One line, as the HTTP front end logs it (a hostile body must not write a
            # traceback); Envoy gets a 500 in the API's shape while it can still take one.
            log.error("request %s failed: %s: %.200s", request_id, type(e).__name__, e)
            if conv.written:
                raise
            err = APIError(500, "internal error in the gateway", code="internal_error")
            await conv.write(self.refusal(err, endpoint, request_id))

    def refusal(
        self, e: APIError, endpoint: Endpoint | None, request_id: str
    ) -> protocol.ProcessingResponse:
        """``e`` as Envoy's immediate response, in the API's own error shape."""
        resp = anthropic.error_response(e) if endpoint == "messages" else e.response()
        assert isinstance(resp.body, bytes)
        headers = {**e.headers, "content-type": "application/json", "x-request-id": request_id}
        if e.status == 401:
            headers["www-authenticate"] = "Bearer"
        return protocol.immediate(e.status, resp.body, headers)

    def client_of(self, headers: Mapping[str, str], tenant: str) -> str:
        """Whose share of the shared budgets: the tenant with auth on, else the client's
        address as Envoy appended it to X-Forwarded-For (its last entry)."""
        if self.gw.config.auth.enabled:
            return f"tenant:{tenant}"
        forwarded = headers.get("x-forwarded-for", "")
        return peer_key(forwarded.rsplit(",", 1)[-1].strip() or None)

    async def routed(
        self,
        conv: Conversation,
        first: protocol.ProcessingRequest,
        headers: CIMultiDict[str],
        endpoint: Endpoint,
        request_id: str,
    ) -> None:
        gw = self.gw
        modes = protocol.body_modes(first, self.default_mode)
        subset = protocol.subset_hint(first)
        tenant = gw.tenancy.identify(headers)  # before a byte of the body is read
        coding = _coding(headers)
        if modes[0] == protocol.BUFFERED:
            await conv.write(protocol.request_headers_response())  # then Envoy sends the body
        client = self.client_of(headers, tenant)
        raw = await self.read_body(conv, client)
        limit = gw.config.limits.max_body_bytes
        body = await gw.json_check.body(raw, coding, client, limit)
        client_headers = CIMultiDict((k, v) for k, v in headers.items() if not k.startswith(":"))
        with gw.held.hold(client, len(body)):
            rr = await gw.path.prepare(
                body, client_headers, endpoint, request_id, tenant, lazy=True, limited=True
            )
            if endpoint == "responses" and self.responses is not None:
                rr = await self.responses(rr, tenant)
            only = self.allowed(rr.model, subset)
            upstream = self.upstream_headers(client_headers, request_id)
            gw.metrics.front_end_requests.labels("ext_proc").inc()
            leg = EnvoyLeg(conv, modes, headers, raw, self.fallbacks(rr.model, only), self.url_at)
            await Exchange(gw.exchanges, rr, client_headers, upstream, leg, only=only).run()

    async def read_body(self, conv: Conversation, client: str) -> bytes:
        """The request body's chunks until Envoy marks its end, within ``max_body_bytes`` and
        the in-flight budget (charged as they arrive, given back once it is in)."""
        gw = self.gw
        limit = gw.config.limits.max_body_bytes
        budget = gw.body_bytes
        chunks: list[bytes] = []
        got = 0
        try:
            while True:
                msg = await conv.read()
                if msg is None:
                    raise APIError(400, "the request body ended early", code="body_incomplete")
                if msg.HasField("request_trailers"):
                    break
                if not msg.HasField("request_body"):
                    continue
                chunk = msg.request_body.body
                if got + len(chunk) > limit:
                    gw.metrics.rejected.labels("body_too_large").inc()
                    raise APIError(
                        413,
                        f"request body too large: more than {limit} bytes",
                        code="body_too_large",
                    )
                if budget.take(client, len(chunk)) is not None:
                    gw.metrics.rejected.labels("inflight_bytes").inc()
                    raise APIError(
                        503,
                        "the gateway is receiving too many request bytes at once; retry shortly",
                        code="overloaded",
                    )
                got += len(chunk)
                chunks.append(chunk)
                if msg.request_body.end_of_stream:
                    break
        finally:
            budget.give_back(client, got)
        return b"".join(chunks)

    def allowed(self, model: str, subset: frozenset[str] | None) -> frozenset[str] | None:
        """The replicas a subset hint lets the request go to (None: any); a 503 when none of
        the model's replicas is in it."""
        if subset is None:
            return None
        fleet = self.gw.fleet
        assert fleet is not None
        only = frozenset(r.url for r in fleet.serving(model) if endpoint_of(r.url) in subset)
        if not only:
            raise APIError(
                503,
                "no replica in the endpoint subset Envoy allows can serve this request",
                code="no_replica",
            )
        return only

    def fallbacks(self, model: str, only: frozenset[str] | None) -> Any:
        """The replicas Envoy may try after a primary that refuses the connection: the other
        healthy replicas of the model that can serve what Envoy sends (the whole request, or
        a disaggregated request's decode leg: never a prefill replica), least loaded first."""

        def after(primary: str) -> list[str]:
            fleet = self.gw.fleet
            assert fleet is not None
            others = [
                r
                for r in fleet.serving(model)
                if r.url != primary and in_pool(r, "decode") and (only is None or r.url in only)
            ]
            others.sort(key=lambda r: (r.pending_requests, r.inflight))
            # ext_proc_fallbacks, 0 by default: an ORIGINAL_DST cluster reading the header
            # takes one host:port (envoy original_dst_cluster.cc, "invalid override header
            # value") and every GIE gateway seen routes a pool through one.
            return [r.url for r in others[: self.gw.config.server.ext_proc_fallbacks]]

        return after

    def url_at(self, endpoint: str) -> str | None:
        fleet = self.gw.fleet
        assert fleet is not None
        return next((url for url in fleet.replicas if endpoint_of(url) == endpoint), None)

    def upstream_headers(self, client: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
        """The client's headers as a replica may see them (the relay's rules)."""
        config = self.gw.config
        return request_headers(
            client,
            request_id,
            config.forwarding.upstream_api_key,
            forward_authorization=not config.auth.enabled,
            allow=self.gw.forward_allow,
        )

    async def unrouted(
        self,
        conv: Conversation,
        first: protocol.ProcessingRequest,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> None:
        """A request the gateway does not route on a prompt: the least-loaded healthy
        replica (in the subset, if any), the same headers a replica sees from the relay, and
        the stream ends once routed (Envoy relays the rest unwatched)."""
        self.gw.tenancy.identify(headers)  # the same key check as every other endpoint
        fleet = self.gw.fleet
        assert fleet is not None
        subset = protocol.subset_hint(first)
        replicas = [
            r
            for r in fleet.replicas.values()
            if r.healthy and (subset is None or endpoint_of(r.url) in subset)
        ]
        if not replicas:
            raise APIError(503, "no healthy replica is available", code="no_replica")
        best = min(replicas, key=lambda r: (r.pending_requests, r.inflight))
        endpoint = endpoint_of(best.url)
        client = CIMultiDict((k, v) for k, v in headers.items() if not k.startswith(":"))
        upstream = self.upstream_headers(client, request_id)
        upstream.popall("Content-Type", None)  # as sent: nothing here reads the body
        set_, remove = request_mutation(headers, upstream, {protocol.DESTINATION: endpoint})
        pick = protocol.request_headers_response(
            protocol.mutation(set_, remove), protocol.pick_metadata(endpoint)
        )
        modes = protocol.body_modes(first, self.default_mode)
        if first.request_headers.end_of_stream or modes[0] == protocol.BUFFERED:
            await conv.write(pick)
            return
        # Full duplex: the body is on its way to the picker, which must send it back.
        body = await self.read_body(conv, self.client_of(headers, "unrouted"))
        await conv.write(pick)
        for chunk in protocol.streamed_chunks(body, end=True):
            await conv.write(chunk)
