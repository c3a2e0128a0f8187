"""The aiohttp application: routes, lifecycle, and the request path.

    parse -> tenancy -> prompt -> blocks -> schedule -> forward -> learn

``Gateway.prepare`` and ``Gateway.decide`` are the request path up to the decision; the live
handler and the explain endpoint both call them, so nothing is re-implemented for explaining.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import itertools
import json
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router import blocks
from router.api import routes as api_routes
from router.api.convert import to_chat
from router.body import read_body as read_request_body
from router.config import Config
from router.errors import APIError, bad_request
from router.fleet import Fleet, Replica
from router.forward import (
    STREAM_ERROR_SHAPES,
    Outcome,
    UpstreamUnavailable,
    header_allow_list,
    proxy,
    request_headers,
)
from router.index import MemoryIndex, PrefixIndex
from router.metrics import Metrics
from router.outlier import OutlierPolicy
from router.prompt import NeedsThread, Renderer
from router.request import Endpoint, RoutedRequest
from router.schedule import Decision, HashRing, from_config
from router.tenancy import SaltDecision, Tenancy
from router.upstream import UpstreamPool

log = logging.getLogger("prefix_router")

DEFAULT_BLOCK_SIZE = 16
APP_HEADER = "X-Prefix-Router-App"  # optional client label that diagnostics group by
INLINE_UNCACHED_CHARS = 4096  # more new text than this is tokenized in a thread (~1 ms)
LARGE_BODY_BYTES = 256 * 1024  # bodies beyond this are parsed and rendered in a thread
LINGER_S = 1.0  # how long an unread body is drained before its connection closes
REQUEST_ID = web.RequestKey("request_id", str)
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


@dataclass(frozen=True, slots=True)
class _Admitted:
    """A parsed request whose model is served and whose salt is decided."""

    endpoint: Endpoint
    body: dict[str, Any]  # as it will be forwarded (the salt policy applied)
    client_body: dict[str, Any]  # as the client sent it
    model: str
    lora: str | None
    salt: SaltDecision
    chat: dict[str, Any] | None = None  # the chat body rendered, for every API but completions


def release_free_memory() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the OS (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Gateway:
    """One gateway process: its fleet view, index, policy and upstream session."""

    def __init__(
        self, config: Config, renderer: Renderer | None = None, index: PrefixIndex | None = None
    ) -> None:
        self.config = config
        self.renderer = renderer
        self.metrics = Metrics()
        self.tenancy = Tenancy(config)
        self.index: PrefixIndex = index or MemoryIndex(config.capacity_blocks or 65_536)
        self.ring = HashRing(virtual_nodes=config.virtual_nodes)
        self.policy = from_config(config, self.ring)  # config.schedule + the policy flags
        self.block_size = config.block_size or DEFAULT_BLOCK_SIZE
        self.chain_cache = blocks.ChainCache()
        self.session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.executor = ThreadPoolExecutor(
            max(1, config.tokenize_threads), thread_name_prefix="tokenize"
        )
        # The proxy path's own client (router/upstream.py); ``session`` serves the fleet's
        # health checks and scrapes.
        self.upstream = UpstreamPool(
            connect_timeout=config.connect_timeout_s,
            read_timeout=max(config.first_byte_timeout_s, config.idle_timeout_s),
        )
        self.forward_allow = header_allow_list(config.auth, config.forward_headers)
        self.draining = False
        self._background: set[asyncio.Task[Any]] = set()
        # Watchers of every finished request (live diagnostics, attached by the admin
        # extension): observe(rr, decision, outcome)
        self.observers: list[Any] = []
        self.redis: Any = None  # fleet mode: the shared client, the sync task
        self.sync: Any = None
        self.discovery: Any = None  # DNS discovery of replicas, when configured
        self._fallbacks_seen = 0
        self._receiving_bytes = 0  # bytes reserved by bodies being read right now

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        headers = (
            {"Authorization": f"Bearer {self.config.upstream_api_key}"}
            if self.config.upstream_api_key
            else {}
        )
        self.fleet = Fleet(
            self.config.replicas,
            self.session,
            health_interval_s=self.config.health_interval_s,
            metrics_interval_s=self.config.metrics_interval_s,
            outlier=outlier_policy(self.config),
            first_byte_timeout_s=self.config.first_byte_timeout_s,
            first_byte_timeout_floor_s=self.config.first_byte_timeout_floor_s,
            first_byte_timeout_factor=self.config.first_byte_timeout_factor,
            upstream_headers=headers,
            on_event=self._on_fleet_event,
        )
        await self.fleet.start()
        if self.config.discovery_dns:
            from router.discovery import DnsDiscovery

            self.discovery = DnsDiscovery.from_config(self.config, self._on_discovered)
            await self.discovery.start()  # the first lookup completes before serving
        if self.config.redis_url:
            await self._start_fleet_mode()
        self._sync_ring()
        if self.config.block_size is None:
            self.block_size = self.fleet.block_size() or DEFAULT_BLOCK_SIZE
        for r in self.fleet.replicas.values():
            await self._apply_capacity(r)
        if self.renderer is None:
            try:
                self.renderer = await asyncio.get_running_loop().run_in_executor(
                    self.executor,
                    load_renderer,
                    self.config.tokenizer,
                    self.fleet.base_model(),
                    self.config.max_prompt_chars,
                )
            except BaseException:
                await self.stop()  # exit cleanly: no half-open sessions or tasks left behind
                raise
        log.info(
            "gateway ready: %d replicas (%d healthy), policy %s, block size %d",
            len(self.fleet.replicas),
            len(self.fleet.healthy()),
            self.policy.name,
            self.block_size,
        )

    async def _on_discovered(self, urls: list[str]) -> None:
        assert self.fleet is not None
        await self.fleet.set_urls(urls)
        for r in self.fleet.replicas.values():
            await self._apply_capacity(r)
        self._sync_ring()

    async def _start_fleet_mode(self) -> None:
        """Share the prefix map, the ring's members and the load with the other gateways
        through Redis. Redis being down only degrades routing to this gateway's local view."""
        from router.index.redis import RedisIndex, make_client
        from router.index.resilient import ResilientIndex
        from router.shared_state import FleetSync, new_gateway_id

        assert self.fleet is not None and self.config.redis_url
        model = self.fleet.base_model() or "default"
        self.redis = make_client(self.config.redis_url)
        capacity = self.config.capacity_blocks or 65_536
        shared = RedisIndex(
            self.redis, model, namespace=self.config.redis_prefix, default_capacity=capacity
        )
        index = ResilientIndex(
            shared, MemoryIndex(capacity), match_timeout_s=self.config.redis_timeout_ms / 1000
        )
        client = self.redis

        async def disconnect_pool() -> None:
            try:
                await client.connection_pool.disconnect()
            except Exception as exc:
                log.debug("dropping pooled Redis connections failed: %r", exc)

        def drop_pooled_connections() -> None:
            # Connections pooled before an outage are dead sockets that redis-py hands out
            # again once Redis is back: each fails one call, which re-opens the circuit for
            # another probe interval (a restart flapped for seconds). Drop them all while
            # Redis is down; calls reconnect on demand.
            self._spawn(disconnect_pool())

        def on_redis_state(up: bool) -> None:
            self.metrics.redis_up.set(1 if up else 0)
            if not up:
                drop_pooled_connections()

        index.on_state_change(on_redis_state)
        self.metrics.redis_up.set(1 if await index.start() else 0)
        self.index = index
        fleet = self.fleet

        def local_load() -> dict[str, tuple[int, int]]:
            return {u: (r.inflight, r.pending_prefill_tokens) for u, r in fleet.replicas.items()}

        sync_was_up = True

        def on_tick(sync: FleetSync) -> None:
            nonlocal sync_was_up
            if sync_was_up and sync.redis_up is False:
                drop_pooled_connections()
            sync_was_up = sync.redis_up is not False
            remote = sync.remote_load
            for url, r in fleet.replicas.items():
                r.remote_inflight, r.remote_prefill_tokens = remote.get(url, (0, 0))
            self._sync_ring()

        self.sync = FleetSync(
            self.redis,
            model,
            new_gateway_id(),
            local_load,
            lambda: {r.url for r in fleet.healthy()},
            namespace=self.config.redis_prefix,
            interval_s=self.config.sync_interval_s,
            on_tick=on_tick,
        )
        await self.sync.start()

    async def stop(self) -> None:
        self.draining = True
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        if self.sync is not None:
            await self.sync.stop()
        if self.fleet:
            await self.fleet.stop()
        await self.index.close()
        if self.redis is not None:
            await self.redis.aclose()
        if self.session:
            await self.session.close()
        self.upstream.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _sync_ring(self) -> None:
        """The ring holds the replicas some gateway sees healthy (fleet mode: the same set on
        every gateway, so cold prefixes land alike); routing still skips what this gateway
        sees down."""
        assert self.fleet is not None
        members = self.sync.members if self.sync is not None else None
        if members is None:
            members = {r.url for r in self.fleet.healthy()}
        self.ring.set_members(members)
        for url, r in self.fleet.replicas.items():
            self.metrics.replica_healthy.labels(url).set(1 if r.healthy else 0)

    async def _apply_capacity(self, replica: Replica) -> None:
        blocks_ = self.config.capacity_blocks or replica.stats.num_gpu_blocks
        if blocks_:
            await self.index.set_capacity(replica.url, blocks_)

    async def _on_fleet_event(self, replica: Replica, event: str) -> None:
        if event in ("removed", "restarted"):
            await self.index.drop_replica(replica.url)
        if event == "capacity":
            await self._apply_capacity(replica)
        if event == "ejected":
            self.metrics.ejections.labels(replica.url, replica.ejection_reason or "").inc()
        self._sync_ring()

    # -- the request path -------------------------------------------------------------------
    async def prepare(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        request_id: str,
        tenant: str | None = None,
    ) -> RoutedRequest:
        """Identify the tenant, parse, apply the salt policy, tokenize and hash. Needs no
        replica: ``prefix-router explain`` runs it offline. ``tenant``: already identified
        (from the headers, before the body was read)."""
        if tenant is None:
            tenant = self.tenancy.identify(headers)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        if len(raw) > LARGE_BODY_BYTES:
            # Parsing, normalising and rendering a big body is pure Python: in a thread the
            # interpreter hands the event loop the GIL every few ms, so /health and other
            # requests keep being answered meanwhile.
            admitted, token_ids = await loop.run_in_executor(
                self.executor, self._admit_and_tokenize, raw, endpoint, tenant
            )
        else:
            admitted = self._admit(raw, endpoint, tenant)
            try:
                # Cached segments cost microseconds: tokenize in place, and hand a prompt with
                # a lot of new text to a thread (the Rust tokenizer releases the GIL there).
                with self._renderer().inline(INLINE_UNCACHED_CHARS):
                    token_ids = self._tokenize(admitted)
            except NeedsThread:
                token_ids = await loop.run_in_executor(self.executor, self._tokenize, admitted)
        body, salt = admitted.body, admitted.salt
        hashes = self.chain_cache.block_hashes(
            token_ids,
            self.block_size,
            cache_salt=salt.salt,
            lora=admitted.lora,
            max_blocks=self.config.max_hashed_blocks,
        )
        self.metrics.tokenize_latency.observe(time.perf_counter() - t0)
        limits = admitted.chat if admitted.chat is not None else body
        max_tokens = limits.get("max_completion_tokens", limits.get("max_tokens"))
        app_label = headers.get(APP_HEADER) or None
        return RoutedRequest(
            request_id=request_id,
            endpoint=endpoint,
            model=admitted.model,
            tenant=tenant,
            body=body,
            stream=bool(body.get("stream", False)),
            token_ids=token_ids,
            block_size=self.block_size,
            block_hashes=hashes,
            cache_salt=salt.salt,
            lora=admitted.lora,
            salt_policy=salt.policy,
            app_label=app_label[:64] if app_label else None,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            # Unchanged bodies are forwarded as the client's own bytes.
            extras={"raw": raw if body is admitted.client_body else None},
        )

    def _renderer(self) -> Renderer:
        assert self.renderer is not None
        return self.renderer

    def _admit(self, raw: bytes, endpoint: Endpoint, tenant: str) -> _Admitted:
        """Parse the body, check that some replica serves its model, and decide its salt:
        everything that comes before tokenizing. A request for a model nobody serves is
        refused here, so it cannot be used to time the tokenizer's caches for free."""
        body = parse_body(raw, endpoint)
        model = body.get("model")
        fleet = self.fleet
        if model is None:
            model = (fleet.base_model() if fleet else None) or ""
        if fleet is not None:
            self._serving(model)
        lora = model if fleet and fleet.adapter_parent(model) else None
        chat = to_chat(endpoint, body)
        salt = self.tenancy.salt(
            tenant, body.get("cache_salt"), chat.get("messages") if chat is not None else None
        )
        client_body = body
        if salt.salt != body.get("cache_salt"):
            body = dict(body)
            if salt.salt is None:
                body.pop("cache_salt", None)
            else:
                body["cache_salt"] = salt.salt
            if endpoint == "chat":
                chat = body
        return _Admitted(endpoint, body, client_body, model, lora, salt, chat)

    def _tokenize(self, admitted: _Admitted) -> Sequence[int]:
        renderer = self._renderer()
        # The segment cache is scoped like the replicas' prefix caches: by the salt sent.
        with renderer.cache_scope(admitted.salt.salt):
            if admitted.chat is not None:
                return renderer.chat_ids(admitted.chat)
            # Honours add_special_tokens and truncation; a batch routes on its first prompt.
            return renderer.completion_request_ids(admitted.body)[0]

    def _admit_and_tokenize(
        self, raw: bytes, endpoint: Endpoint, tenant: str
    ) -> tuple[_Admitted, Sequence[int]]:
        admitted = self._admit(raw, endpoint, tenant)
        return admitted, self._tokenize(admitted)

    def _serving(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The replicas that can take a request for ``model``, or the error that says why
        none can."""
        assert self.fleet is not None
        replicas = [r for r in self.fleet.serving(model) if r.url not in exclude]
        if not replicas:
            if not self.fleet.healthy():
                raise APIError(503, "no healthy replica is available", code="no_replica")
            if exclude:
                raise APIError(
                    502, "every replica that serves this model failed", code="upstream_failed"
                )
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return replicas

    async def decide(self, rr: RoutedRequest, exclude: frozenset[str] = frozenset()) -> Decision:
        t0 = time.perf_counter()
        replicas = self._serving(rr.model, exclude)
        if pinned := rr.extras.get("pinned_replica"):  # holds the state the request names
            replicas = [r for r in replicas if r.url == pinned] or replicas
        urls = [r.url for r in replicas]
        matches = await self.index.match(rr.block_hashes, urls) if self.policy.uses_index else {}
        decision = self.policy.choose(rr, [r.candidate(matches.get(r.url, 0)) for r in replicas])
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        return decision

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, once the headers were authenticated: bounded in time and in the
        bytes all requests may be sending at once, so slow or huge bodies cannot pile up."""
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise APIError(
                413,
                f"request body too large: {length} bytes, the limit is {limit}",
                code="body_too_large",
                close_connection=True,
            )
        reserve = length if length is not None else limit
        if self._receiving_bytes + reserve > self.config.max_inflight_body_bytes:
            self.metrics.rejected.labels("inflight_bytes").inc()
            raise APIError(
                503,
                "the gateway is receiving too many request bytes at once; retry shortly",
                code="overloaded",
                close_connection=True,
            )
        self._receiving_bytes += reserve
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await read_request_body(request, limit)
        except TimeoutError:
            self.metrics.rejected.labels("body_timeout").inc()
            raise APIError(
                408,
                f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                code="body_timeout",
                close_connection=True,
            ) from None
        finally:
            self._receiving_bytes -= reserve

    async def route(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = request[REQUEST_ID]
        tenant = self.tenancy.identify(request.headers)  # before reading a byte of the body
        raw = await self.read_body(request)
        try:
            rr = await self.prepare(raw, request.headers, endpoint, request_id, tenant)
            return await self._route(request, rr)
        finally:
            if len(raw) > LARGE_BODY_BYTES:
                self._spawn(self._trim_heap())

    async def _trim_heap(self) -> None:
        """Hand the memory a large request used back to the OS (glibc keeps freed arenas)."""
        await asyncio.get_running_loop().run_in_executor(self.executor, release_free_memory)

    async def _route(self, request: web.Request, rr: RoutedRequest) -> web.StreamResponse:
        request_id = rr.request_id
        assert self.fleet is not None
        raw = rr.extras.get("raw")
        body = raw if raw is not None else json.dumps(rr.body).encode()
        headers = request_headers(
            request.headers,
            request_id,
            self.config.upstream_api_key,
            forward_authorization=not self.config.auth,
            allow=self.forward_allow,
        )
        self.metrics.tenant_requests.labels(rr.tenant).inc()
        self.metrics.prompt_tokens.labels(rr.tenant).inc(rr.num_tokens)
        tried: set[str] = set()
        while True:
            decision = await self.decide(rr, frozenset(tried))
            replica = self.fleet.replicas[decision.replica]
            self.policy.placed(decision)
            extra = {"x-request-id": request_id}
            if self.config.decision_headers:
                extra["x-prefix-router-replica"] = replica.url
                extra["x-prefix-router-cached-blocks"] = str(decision.matched_blocks)
            try:
                resp, outcome = await self._send(
                    request, rr, replica, decision, body, headers, extra
                )
            except UpstreamUnavailable as e:
                tried.add(replica.url)
                # It never computed the blocks recorded for it above: take back what was new.
                unsent = rr.block_hashes[decision.matched_blocks :]
                if self.redis is None:
                    await self.index.forget(replica.url, unsent)
                else:
                    self._spawn(self.index.forget(replica.url, unsent))
                self.metrics.retries.labels(replica.url, e.why).inc()
                self.metrics.requests.labels(replica.url, decision.policy, "unavailable").inc()
                await self.fleet.record_failure(replica, e.why)
                self._sync_ring()
                if len(tried) > self.config.max_retries:
                    raise APIError(
                        502,
                        f"upstream replica unavailable ({e.why}) after {len(tried)} attempts",
                        code="upstream_unavailable",
                    ) from e
                log.info(
                    "request %s: %s failed before the first byte (%s); retrying",
                    request_id,
                    replica.url,
                    e.why,
                )
                continue
            await self.fleet.record_response(
                replica,
                outcome.status,
                stream=rr.stream,
                first_byte_s=outcome.first_byte_s,
                completion_tokens=outcome.completion_tokens,
            )
            # After the response is written (the next loop turn, before any new request).
            asyncio.get_running_loop().call_soon(self._learn, rr, decision, outcome)
            return resp

    async def _record_placement(self, rr: RoutedRequest, decision: Decision) -> None:
        """The chosen replica will hold the prompt's blocks. Runs while the request is on
        its way (``UpstreamPool.post``), and before anything else runs on this loop."""
        if self.redis is None:
            await self.index.record(decision.replica, rr.block_hashes)
        else:  # a Redis write stays off the request's critical path
            self._spawn(self.index.record(decision.replica, rr.block_hashes))
        self.metrics.decisions.labels(decision.policy, decision.reason).inc()

    async def _send(
        self,
        request: web.Request,
        rr: RoutedRequest,
        replica: Replica,
        decision: Decision,
        body: bytes,
        headers: Any,
        extra: dict[str, str],
    ) -> tuple[web.StreamResponse, Outcome]:
        """Forward with load accounting: in flight until done, pending prefill until the
        first byte."""
        uncached = max(0, rr.num_tokens - decision.matched_blocks * rr.block_size)
        replica.inflight += 1
        replica.pending_requests += 1
        replica.pending_prefill_tokens += uncached
        gauge = self.metrics.inflight.labels(replica.url)
        gauge.inc()
        pending = True

        def first_byte() -> None:
            nonlocal pending
            if pending:
                pending = False
                replica.pending_requests -= 1
                replica.pending_prefill_tokens -= uncached

        assert self.fleet is not None
        tokens, n = rr.max_tokens, rr.body.get("n")
        if tokens is not None and type(n) is int and n > 1:
            tokens *= n  # completion_tokens counts every choice
        timeout = self.fleet.first_byte_timeout(replica, rr.stream, tokens)
        try:
            url = replica.url + PATHS[rr.endpoint]
            return await proxy(
                cast(UpstreamPool, _HeadersWithin(self.upstream, timeout)),
                request,
                url,
                body,
                headers,
                extra,
                on_first_byte=first_byte,
                on_sent=lambda: self._record_placement(rr, decision),
                stream_error=STREAM_ERROR_SHAPES[rr.endpoint],
            )
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            self.metrics.requests.labels(replica.url, decision.policy, "client_gone").inc()
            raise
        finally:
            first_byte()
            replica.inflight -= 1
            gauge.dec()

    def _learn(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        """Compare the prediction with what the replica reports, and correct the index."""
        outcome_label = (
            "ok"
            if outcome.status < 400 and outcome.complete
            else (f"http_{outcome.status}" if outcome.status >= 400 else "broken")
        )
        self.metrics.requests.labels(decision.replica, decision.policy, outcome_label).inc()
        self.metrics.upstream_ttft.labels(decision.replica).observe(outcome.first_byte_s)
        predicted = decision.matched_blocks * rr.block_size
        self.metrics.predicted_cached_tokens.labels(rr.tenant).inc(predicted)
        for observer in self.observers:
            observer.observe(rr, decision, outcome)
        if outcome.cached_tokens is None:
            return
        reported = outcome.cached_tokens
        self.metrics.reported_cached_tokens.labels(rr.tenant).inc(reported)
        self.metrics.prediction_error.observe(predicted - reported)
        if reported == 0 and decision.matched_blocks >= 2:
            # The replica held none of what we believed it held: its cache was lost (restart,
            # reset) behind our back. Forget everything we believed about it but this request.
            log.info(
                "replica %s reported no cached tokens where %d were predicted; resetting its index",
                decision.replica,
                predicted,
            )
            self._spawn(self._reset_replica(decision.replica, rr.block_hashes))

    async def _reset_replica(self, url: str, keep: list[int]) -> None:
        await self.index.drop_replica(url)
        if self.fleet and url in self.fleet.replicas:
            await self._apply_capacity(self.fleet.replicas[url])
        await self.index.record(url, keep)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- handlers -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, "completions")

    async def models(self, request: web.Request) -> web.Response:
        self.tenancy.identify(request.headers)  # same auth as generation
        assert self.fleet is not None
        cards = sorted(self.fleet.models().values(), key=lambda c: str(c.get("id")))
        return web.json_response({"object": "list", "data": cards})

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """/tokenize and /detokenize: forwarded to the least-loaded healthy replica."""
        self.tenancy.identify(request.headers)
        assert self.fleet is not None
        raw = await self.read_body(request)
        parse_json_object(raw)
        headers = request_headers(
            request.headers,
            request[REQUEST_ID],
            self.config.upstream_api_key,
            not self.config.auth,
            self.forward_allow,
        )
        tried: set[str] = set()
        for _ in range(self.config.max_retries + 1):
            replicas = [r for r in self.fleet.healthy() if r.url not in tried]
            if not replicas:
                break
            replica = min(replicas, key=lambda r: (r.inflight, r.url))
            try:
                resp, _ = await proxy(
                    self.upstream,
                    request,
                    replica.url + request.path,
                    raw,
                    headers,
                    {"x-request-id": request[REQUEST_ID]},
                )
                return resp
            except UpstreamUnavailable as e:
                tried.add(replica.url)
                await self.fleet.record_failure(replica, e.why)
        raise APIError(503, "no healthy replica is available", code="no_replica")

    def _check_admin(self, request: web.Request) -> None:
        """The admin key, as ``X-Admin-Key`` or as a bearer token (what Prometheus'
        ``authorization`` scrape setting sends)."""
        key = self.config.admin_key
        given = request.headers.get("X-Admin-Key", "")
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        if not given and scheme.lower() == "bearer":
            given = bearer.strip()
        if not key or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "with auth on, /metrics needs the admin key (X-Admin-Key or Authorization: "
                "Bearer), or scrape the metrics_port listener",
                code="invalid_admin_key",
            )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        assert self.fleet is not None
        healthy = len(self.fleet.healthy())
        ok = healthy > 0 and not self.draining
        return web.json_response(
            {
                "ready": ok,
                "healthy_replicas": healthy,
                "replicas": len(self.fleet.replicas),
                "draining": self.draining,
            },
            status=200 if ok else 503,
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        if self.config.auth:
            # Tenant names, per-tenant counts and replica URLs are not for every API key:
            # the admin key, or the separate metrics_port (a scrape-only listener).
            self._check_admin(request)
        return self.prometheus_text()

    async def prometheus_unauthenticated(self, request: web.Request) -> web.Response:
        return self.prometheus_text()

    def prometheus_text(self) -> web.Response:
        if self.fleet:
            for url in self.fleet.replicas:
                self.metrics.index_blocks.labels(url).set(self.index.size(url))
        fallbacks = getattr(self.index, "fallbacks", 0)
        if fallbacks > self._fallbacks_seen:
            self.metrics.redis_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


class _HeadersWithin:
    """The upstream pool as ``proxy`` sees it for one request: its wait for response
    headers bounded by ``timeout`` (what ``Fleet.first_byte_timeout`` derived)."""

    __slots__ = ("pool", "timeout")

    def __init__(self, pool: UpstreamPool, timeout: float | None) -> None:
        self.pool = pool
        self.timeout = timeout

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        on_sent: Any = None,
    ) -> Any:
        return await self.pool.post(url, body, headers, on_sent, timeout=self.timeout)


def outlier_policy(config: Config) -> OutlierPolicy:
    return OutlierPolicy(
        window_s=config.outlier_window_s,
        min_requests=config.outlier_min_requests,
        error_ratio=config.outlier_error_ratio,
        consecutive_failures=config.eject_after_failures,
        base_ejection_s=config.ejection_base_s,
        max_ejection_s=config.ejection_max_s,
        max_ejected_percent=config.max_ejected_percent,
        decay_s=config.ejection_decay_s,
    )


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """Validate the fields routing reads; everything else is forwarded untouched."""
    body = parse_json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise bad_request("stream must be a boolean", "stream")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad_request(f"{key} must be a non-negative integer", key)
    if endpoint in ("messages", "responses"):
        return body  # checked by its converter (router/api/)
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("prompt is required", "prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
    return body


def _model_vocab_size(name: str) -> int:
    """Token ids a completions prompt may carry: the model's ``vocab_size`` from a
    ``config.json`` beside the tokenizer (it is larger than the tokenizer's own vocabulary,
    e.g. 151,936 vs 151,669 for Qwen3), else anything a uint32 holds: the replica judges."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return int(json.loads((Path(name) / "config.json").read_text())["vocab_size"])
    return 2**32 - 1


def load_renderer(
    tokenizer: str | None, reported_model: str | None, max_prompt_chars: int = 4_000_000
) -> Renderer:
    name = tokenizer or reported_model
    if not name:
        raise SystemExit(
            "prefix-router: no --tokenizer given and no replica reported a model "
            "in /v1/models; pass --tokenizer PATH_OR_MODEL_ID"
        )
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        raise SystemExit(f"prefix-router: tokenizer directory {name!r} does not exist")
    try:
        from transformers import AutoTokenizer

        # Local files only: the request path must never wait on a model hub, and offline a
        # hub lookup only retries for half a minute before failing anyway.
        return Renderer(
            AutoTokenizer.from_pretrained(name, local_files_only=True),
            vocab_size=_model_vocab_size(name),
            max_prompt_chars=max_prompt_chars,
        )
    except Exception as e:  # transformers raises OSError, ValueError, HF errors...
        hint = (
            ""
            if tokenizer
            else " (the model the replicas report; pass --tokenizer to choose another)"
        )
        raise SystemExit(
            f"prefix-router: cannot load tokenizer {name!r}{hint}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
            "Point --tokenizer at a local directory with tokenizer.json and "
            "tokenizer_config.json, or fetch the model into the Hugging Face cache first."
        ) from None


# -- middleware ---------------------------------------------------------------------------
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """Unique per process start and request; a counter, because uuid4 per request showed up
    in profiles."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id") or new_request_id()
    if len(request_id) > 128 or not request_id.isprintable():
        request_id = new_request_id()
    request[REQUEST_ID] = request_id
    rid = {"x-request-id": request_id}
    try:
        resp = await handler(request)
    except APIError as e:
        if e.status == 401:
            rid["WWW-Authenticate"] = "Bearer"
        return e.response(rid)
    except web.HTTPRequestEntityTooLarge as e:
        return APIError(413, f"request body too large: {e.text}").response(rid)
    except web.HTTPException as e:
        if e.status >= 400:
            return APIError(e.status, e.reason or "error").response(rid)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        # One line at the default level: a hostile body must not write a 3,000-line
        # traceback (a RecursionError's) to the log; the bounded traceback is for debug.
        log.error("request %s failed: %s: %.200s", request_id, type(e).__name__, e)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("".join(traceback.format_exception(e, limit=-12)))
        return APIError(500, "internal error in the gateway", code="internal_error").response(rid)
    if not resp.prepared:
        resp.headers.setdefault("x-request-id", request_id)
    return resp


# Adds routes or observers to the app a layer above this one (router/admin.py): the gateway
# names none of them, so nothing here imports the ops modules.
Extension = Callable[[web.Application, "Gateway"], None]


def build_app(
    config: Config,
    renderer: Renderer | None = None,
    index: PrefixIndex | None = None,
    extensions: Sequence[Extension] = (),
) -> web.Application:
    gateway = Gateway(config, renderer, index)
    app = web.Application(
        middlewares=[errors_middleware],
        client_max_size=config.max_body_bytes,
        # A body refused unread (no key, too slow, over budget) is drained for at most this
        # long, so the client can read its answer, then the connection closes (aiohttp's 10 s
        # default let refused uploads hold connections).
        handler_args={"lingering_time": LINGER_S},
    )
    app[GATEWAY_KEY] = gateway
    app.router.add_post("/v1/chat/completions", gateway.chat)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_post("/tokenize", gateway.passthrough)
    app.router.add_post("/detokenize", gateway.passthrough)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/ready", gateway.ready)
    app.router.add_get("/metrics", gateway.prometheus)
    api_routes.register(app, gateway, REQUEST_ID)  # Messages, Responses, forwarded endpoints
    for extend in extensions:
        extend(app, gateway)

    metrics_runner: list[web.AppRunner] = []

    async def on_startup(app: web.Application) -> None:
        await gateway.start()
        if config.metrics_port:
            metrics_runner.append(await _start_metrics_listener(gateway, config))

    async def on_shutdown(app: web.Application) -> None:
        gateway.draining = True

    async def on_cleanup(app: web.Application) -> None:
        for runner in metrics_runner:
            await runner.cleanup()
        await gateway.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def _start_metrics_listener(gateway: Gateway, config: Config) -> web.AppRunner:
    """A scrape-only listener: /metrics without a key, for a port only Prometheus reaches."""
    app = web.Application()
    app.router.add_get("/metrics", gateway.prometheus_unauthenticated)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.metrics_port, reuse_port=config.workers > 1)
    await site.start()
    return runner


@dataclass
class RunningGateway:
    url: str
    runner: web.AppRunner
    gateway: Gateway

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_gateway(
    config: Config,
    renderer: Renderer | None = None,
    index: PrefixIndex | None = None,
    port: int | None = None,
    extensions: Sequence[Extension] = (),
) -> RunningGateway:
    """Start a gateway in this event loop (tests, demo, load tests). ``port=0`` picks one."""
    app = build_app(config, renderer, index, extensions)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.shutdown_grace_s,
        auto_decompress=False,  # router/body.py decodes request bodies, bounded
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port if port is None else port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    host, bound = sock.getsockname()[:2]
    return RunningGateway(f"http://{host}:{bound}", runner, app[GATEWAY_KEY])
