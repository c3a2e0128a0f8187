"""The HTTP surface of one gateway: the generation routes (read the body within bounds,
prepare, then the request's exchange: router/routing/exchange.py), /tokenize
and /detokenize, and health, readiness and metrics.

Everything here drives the gateway's owners (router/gateway.py); nothing below this layer
knows HTTP requests beyond what ``proxy`` relays.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.core.errors import APIError
from router.gateway import LARGE_BODY_BYTES, Gateway, release_free_memory
from router.http.connections import mark_identified
from router.intake.body import content_coding
from router.intake.budget import peer_key
from router.intake.costs import prompt_floor
from router.intake.held import Hold, waiting
from router.intake.parse import parse_json_object
from router.intake.routed_request import Endpoint, RoutedRequest
from router.intake.shapes import check_body
from router.models.fallback import CHARS_PER_TOKEN
from router.routing.exchange import Exchange
from router.routing.forwarder import ModelJob
from router.upstream.proxy import request_headers
from router.upstream.transport import Relay

log = logging.getLogger("prefix_router")

REQUEST_ID = web.RequestKey("request_id", str)
HANDLERS: web.AppKey[Handlers] = web.AppKey("handlers")  # for the ops routes (router/ops/admin.py)


def admin_key_ok(request: web.Request, admin_key: str | None, *, accept_bearer: bool) -> bool:
    """Whether the request presents ``admin_key`` in ``X-Admin-Key`` (or, with
    ``accept_bearer``, as a bearer token); never true when no admin key is configured."""
    given = request.headers.get("X-Admin-Key", "")
    if not given and accept_bearer:
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = bearer.strip()
    return bool(admin_key) and hmac.compare_digest(given.encode(), str(admin_key).encode())


class Handlers:
    """The routes of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.path = gateway.path
        self.exchanges = gateway.exchanges  # a routed request's life (router/routing/exchange.py)
        self.upstream = gateway.upstream  # the relay's client
        self._fallbacks_seen = 0

    def identify(self, request: web.Request) -> str:
        """The request's tenant from its headers (a 401 when auth is on and fails), before a
        byte of its body is read."""
        tenant = self.gw.tenancy.identify(request.headers)
        mark_identified(request)  # its connection keeps the long keep-alive
        return tenant

    def client_of(self, request: web.Request, tenant: str | None) -> str:
        """Whose share of the shared budgets a request draws on: its tenant with auth on (a
        key proved it), else its peer address (with auth off anyone can name any tenant)."""
        if self.gw.config.auth.enabled and tenant is not None:
            return f"tenant:{tenant}"
        return peer_key(request.remote)

    async def read_body(
        self, request: web.Request, *, tenant: str | None = None, as_sent: bool = False
    ) -> bytes:
        """The request body, once the headers were authenticated (``tenant``: whom they
        proved; ``identify``): bounded in time (``body_timeout_s``), in size, and in the bytes
        being received at once, all clients together and per client (``client_of``), each
        byte counted as it arrives, so an announced length reserves nothing. JSON is checked
        first and decoded after, bounded (router/intake/body.py); ``as_sent``: the bytes as they
        came (a multipart upload forwarded whole)."""
        limit = self.gw.config.limits.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise APIError(
                413,
                f"request body too large: {length} bytes, the limit is {limit}",
                code="body_too_large",
                close_connection=True,
            )
        coding = "" if as_sent else content_coding(request)
        client = self.client_of(request, tenant)
        if length:  # cannot fit now: refused before any of it is sent (nothing is reserved)
            self._check_budget(self.gw.body_bytes.fits(client, length))
        try:
            raw = await asyncio.wait_for(
                self._receive(request, client, limit), self.gw.config.limits.body_timeout_s
            )
        except asyncio.TimeoutError:
            self.gw.metrics.rejected.labels("body_timeout").inc()
            raise APIError(
                408,
                f"the request body did not arrive within {self.gw.config.limits.body_timeout_s:g} s",
                code="body_timeout",
                close_connection=True,
            ) from None
        if as_sent:
            return raw
        # Decoded, and a body whose parse could hold the GIL long parsed in another process
        # first: one outside the limits is refused from there (router/intake/json_check.py).
        return await self.gw.json_check.body(raw, coding, client, limit)

    async def _receive(self, request: web.Request, client: str, limit: int) -> bytes:
        """The body's bytes, each chunk charged to ``client``'s share of the in-flight
        budget as it arrives and all of it given back once the body is in (or refused)."""
        budget = self.gw.body_bytes
        chunks: list[bytes] = []
        got = 0
        try:
            while chunk := await request.content.readany():
                if got + len(chunk) > limit:
                    raise APIError(
                        413,
                        f"request body too large: more than {limit} bytes",
                        code="body_too_large",
                        close_connection=True,
                    )
                self._check_budget(budget.take(client, len(chunk)))
                got += len(chunk)
                chunks.append(chunk)
        finally:
            budget.give_back(client, got)
        return b"".join(chunks)

    def _check_budget(self, refused: str | None) -> None:
        if refused is None:
            return
        if refused == "share":
            self.gw.metrics.rejected.labels("client_inflight_bytes").inc()
            raise APIError(
                503,
                "this client is sending too many request bytes at once (its share of the "
                "gateway's in-flight body budget); retry shortly",
                code="overloaded",
                close_connection=True,
            )
        self.gw.metrics.rejected.labels("inflight_bytes").inc()
        raise APIError(
            503,
            "the gateway is receiving too many request bytes at once; retry shortly",
            code="overloaded",
            close_connection=True,
        )

    def hold(self, request: web.Request, tenant: str | None, raw: bytes) -> Hold:
        """The decoded body ``raw`` charged to its client's share of the held-bytes budget
        until the request ends (router/intake/held.py): a 429/503 when it does not fit."""
        return self.gw.held.hold(self.client_of(request, tenant), len(raw))

    async def route(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = request[REQUEST_ID]
        tenant = self.identify(request)  # before reading a byte of the body
        raw = await self.read_body(request, tenant=tenant)
        large = len(raw) > LARGE_BODY_BYTES
        try:
            with self.hold(request, tenant, raw):
                rr = await self.path.prepare(
                    raw, request.headers, endpoint, request_id, tenant, lazy=True, limited=True
                )
                # What waits is one copy of its body, the bytes it forwards (nothing here
                # may keep the client's bytes or the parsed body alive).
                del raw
                rr = waiting(rr)
                return await self.route_prepared(request, rr)
        finally:
            if large:
                self.gw.spawn(self._trim_heap())

    async def _trim_heap(self) -> None:
        """Hand the memory a large request used back to the OS (glibc keeps freed arenas)."""
        await asyncio.get_running_loop().run_in_executor(self.gw.executor, release_free_memory)

    def upstream_headers(self, request: web.Request) -> CIMultiDict[str]:
        """The client's headers as a replica may see them (router/upstream/proxy.py)."""
        config = self.gw.config
        return request_headers(
            request.headers,
            request[REQUEST_ID],
            config.forwarding.upstream_api_key,
            forward_authorization=not config.auth.enabled,
            allow=self.gw.forward_allow,
        )

    async def route_prepared(self, request: web.Request, rr: RoutedRequest) -> web.StreamResponse:
        """A prepared request's life (router/routing/exchange.py), relayed to ``request``'s client."""
        self.gw.metrics.front_end_requests.labels("http").inc()
        relay = Relay(self.upstream, request)
        headers = self.upstream_headers(request)
        return await Exchange(self.exchanges, rr, request.headers, headers, relay).run()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, "completions")

    async def models(self, request: web.Request) -> web.Response:
        tenant = self.identify(request)  # same auth as generation
        assert self.gw.fleet is not None
        cards = sorted(self.gw.fleet.models().values(), key=lambda c: str(c.get("id")))
        tenancy = self.gw.tenancy
        if tenancy.config.auth.enabled and tenancy.policy_of(tenant).models is not None:
            # Only what the tenant's models: allow-list names (directly or by an alias).
            aliases = self.gw.models.aliases
            cards = [
                c
                for c in cards
                if tenancy.may_use(
                    tenant, str(c.get("id")), *(a for a, t in aliases.items() if t == c.get("id"))
                )
            ]
        return web.json_response({"object": "list", "data": cards})

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """/tokenize and /detokenize: forwarded to the least-loaded healthy replica."""
        tenant = self.identify(request)
        # Over its rpm: refused before a byte of its body is read.
        self.path.flow.precheck(tenant, self.gw.tenancy.policy_of(tenant).flow)
        raw = await self.read_body(request, tenant=tenant)
        with self.hold(request, tenant, raw):
            return await self._passthrough(request, tenant, raw)

    async def _passthrough(
        self, request: web.Request, tenant: str, raw: bytes
    ) -> web.StreamResponse:
        # The same bounded shapes as generation bodies: the replica renders and tokenizes
        # these messages too (deep nesting, lone surrogates, 100k messages are a 400 here).
        parsed = parse_json_object(raw)
        check_body(parsed, self.gw.limits)
        model = parsed.get("model")
        self.path.check_model(tenant, model)
        if isinstance(model, str) and self.gw.models.alias(model) != model:
            model = self.gw.models.alias(model)  # the replicas know the served name only
            raw = json.dumps({**parsed, "model": model}).encode()
        # Rate limits only (tokenizing takes no prefill slot); tpm on an estimate.
        await self.path.admit_forwarded(tenant, None, prompt_floor(parsed, CHARS_PER_TOKEN), False)
        job = ModelJob(
            request.path,
            raw,
            self.upstream_headers(request),
            model if isinstance(model, str) else None,
            self.path.serving,
        )
        return await self.gw.forwarder.forward(request, request[REQUEST_ID], job)

    def _check_admin(self, request: web.Request) -> None:
        """The admin key, as ``X-Admin-Key`` or as a bearer token (what Prometheus'
        ``authorization`` scrape setting sends)."""
        if not admin_key_ok(request, self.gw.config.auth.admin_key, accept_bearer=True):
            raise APIError(
                401,
                "with auth on, /metrics needs the admin key (X-Admin-Key or Authorization: "
                "Bearer), or scrape the metrics_port listener",
                code="invalid_admin_key",
            )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness (router/readiness.py): 200 or 503 with status and counts for anyone;
        what it waits for and each model's state (names, paths, errors) only for whoever
        may see them: with an admin key configured, its holder; without one, everyone when
        auth is off (the operator owns the fleet) and no one when it is on."""
        state = self.gw.readiness()
        admin_key = self.gw.config.auth.admin_key
        if admin_key:
            detailed = admin_key_ok(request, admin_key, accept_bearer=True)
        else:
            detailed = not self.gw.config.auth.enabled
        shown = state.detail() if detailed else state.counts()
        if detailed and self.gw.path.disaggregated:  # prefill replicas misconfigured for P/D
            shown["disaggregation"] = self.gw.exchanges.pd.ready_detail()
        return web.json_response(shown, status=200 if state.ready else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        if self.gw.config.auth.enabled:
            # Tenant names, per-tenant counts and replica URLs are not for every API key:
            # the admin key, or the separate metrics_port (a scrape-only listener).
            self._check_admin(request)
        return self.prometheus_text()

    async def prometheus_unauthenticated(self, request: web.Request) -> web.Response:
        return self.prometheus_text()

    def prometheus_text(self) -> web.Response:
        if self.gw.fleet:
            for url in self.gw.fleet.replicas:
                self.gw.metrics.index_blocks.labels(url).set(self.gw.index.size(url))
        shared = self.gw.fleet_mode.index if self.gw.fleet_mode is not None else None
        fallbacks = shared.fallbacks if shared is not None else 0  # Redis answered locally
        if fallbacks > self._fallbacks_seen:
            self.gw.metrics.redis_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
        return web.Response(
            body=self.gw.metrics.exposition(),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
