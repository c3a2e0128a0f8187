"""The gateway: one process's fleet view, index, policy and tenancy, and the request path up to
and after forwarding.

    prepare (parse -> tenancy -> prompt -> blocks) -> decide (schedule) -> [forward] -> learn

``prepare`` and ``decide`` need no HTTP request: the live handlers (router/handlers.py) and the
explain endpoint both call them, so nothing is re-implemented for explaining. Forwarding and
the HTTP surface live one layer up, in router/handlers.py and router/app.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp

from router import blocks, lazy_tail
from router.api.convert import to_chat
from router.budget import SharedBudget, share_of
from router.config import Config
from router.discovery import DnsDiscovery
from router.errors import APIError
from router.fleet import Fleet, Replica
from router.fleet_mode import FleetMode
from router.flow.controller import FlowConfig, FlowController, FlowRequest, Ticket
from router.flow.sessions import ResponseChains, session_of
from router.flow.shared import UsageShare
from router.forward import Outcome, UpstreamUnavailable, header_allow_list
from router.index import MemoryIndex, PrefixIndex
from router.json_check import JsonCheck
from router.kv_events import KVEventSubscriber, SettleOnOutcome, start_for
from router.limits import BodyLimits, check_fits
from router.loading import load_renderer, tokenizer_source
from router.metrics import Metrics
from router.models import ModelEntry, ModelRegistry, Route, fallback
from router.outlier import OutlierPolicy
from router.parse import parse_body, parse_json_object
from router.prompt import NeedsThread, Renderer, segments
from router.prompt.lazy import Head
from router.request import Endpoint, RoutedRequest
from router.schedule import Decision, HashRing, from_config
from router.schedule.observed import is_wait_sample
from router.shared_state import FleetSync
from router.tenancy import SaltDecision, Tenancy
from router.upstream import UpstreamPool

log = logging.getLogger("prefix_router")

DEFAULT_BLOCK_SIZE = 16
APP_HEADER = "X-Prefix-Router-App"  # optional client label that diagnostics group by
# More new text than this is tokenized in a worker thread (~1 ms with Hugging Face's BPE;
# Renderer.loop_encode_chars raises it where a thread cannot help).
INLINE_UNCACHED_CHARS = 4096
LARGE_BODY_BYTES = 256 * 1024  # bodies beyond this are parsed and rendered in a thread


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
    entry: ModelEntry | None = None  # the model's registry entry (router/models/)


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
        self.renderer = renderer  # --tokenizer's (or one handed in): see ModelRegistry
        self.metrics = Metrics()
        # Per served model: renderer, block size, replicas, drift (router/models/).
        self.models = ModelRegistry(
            config.models,
            config.model_aliases,
            flag_tokenizer=config.tokenizer,
            flag_block_size=config.block_size,
            injected=renderer,
            max_prompt_chars=config.max_prompt_chars,
        )
        self.tenancy = Tenancy(config)
        self.limits = BodyLimits.from_config(config)
        self.index: PrefixIndex = index or MemoryIndex(config.capacity_blocks or 65_536)
        self.ring = HashRing(virtual_nodes=config.virtual_nodes)
        self.policy = from_config(config, self.ring)  # config.schedule + the policy flags
        self.block_size = config.block_size or DEFAULT_BLOCK_SIZE
        self.block_size_source = "--block-size" if config.block_size else "the default"
        self.tokenizer_source = "given by the caller" if renderer is not None else "not loaded"
        self.chain_cache = blocks.ChainCache()
        # Route on a prompt's head and tokenize the rest off the critical path
        # (router/lazy_tail.py), where the policy provably decides the same.
        why_not = lazy_tail.policy_allows(self.policy)
        self.lazy_tail = config.lazy_tail and why_not is None
        if config.lazy_tail and why_not is not None:
            log.info("lazy tail off: %s", why_not)
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
        self.fleet_mode: FleetMode | None = None  # Redis shared with other gateways
        self.discovery: DnsDiscovery | None = None  # DNS discovery of replicas, if configured
        self.kv_events: KVEventSubscriber | None = None  # precise mode (router/kv_events/)
        # Request-body bytes being received now, with each client's share (router/handlers.py).
        self.body_bytes = SharedBudget(
            config.max_inflight_body_bytes,
            share_of(config.max_inflight_body_bytes, config.client_share, config.max_body_bytes),
        )
        # Costly JSON bodies are parsed and held to the limits in a child process first, with
        # each client's share of the bytes waiting for it (router/json_check.py).
        self.json_check = JsonCheck(
            self.limits,
            SharedBudget(
                config.max_inflight_body_bytes,
                share_of(
                    config.max_inflight_body_bytes, config.client_share, config.max_body_bytes
                ),
            ),
            self._json_checked,
        )
        self._model_reported = asyncio.Event()  # a replica reported its models (start-up wait)
        # Start-up announcements (router/startup.py): listening, "gateway ready" said, and
        # watchers of the fleet's replica events: await listener(replica, event).
        self.listening = False
        self.announced_ready = False
        self.fleet_listeners: list[Callable[[Replica, str], Awaitable[None]]] = []
        self._models_ready = False  # start-up loaded the registry's tokenizers
        # Flow control (router/flow/): fair queuing per tenant while the replicas are full.
        self.flow = FlowController(
            FlowConfig.from_config(config), self._flow_replicas, self.metrics.registry
        )
        self.flow_share: UsageShare | None = None  # fleet mode: per-tenant usage in Redis
        self.response_chains = ResponseChains()  # Responses chains as one session each

    def _json_checked(self, outcome: str) -> None:
        if outcome == "busy":
            self.metrics.rejected.labels("json_check").inc()
        else:
            self.metrics.json_checks.labels(outcome).inc()

    @property
    def receiving_bytes(self) -> int:
        """Request-body bytes being received now, all clients together."""
        return self.body_bytes.held

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:  # a failed or interrupted start leaves no session or task open
            await self.stop()
            raise

    async def _start(self) -> None:
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
            self.discovery = DnsDiscovery.from_config(self.config, self._on_discovered)
            await self.discovery.start()  # the first lookup completes before serving
        await self._wait_for_a_model()  # the registry, fleet mode's keys need it
        if self.config.redis_url:
            self.fleet_mode = FleetMode(
                self.config, self.fleet, self.metrics, self.spawn, self.sync_ring
            )
            self.index = await self.fleet_mode.start()
        self.sync_ring()
        await self._load_models()
        if self.config.kv_events:
            self.kv_events = await start_for(
                self.config,
                self.fleet,
                self.index,
                self.block_size_of,
                self.metrics,
                self.fleet_mode,
                namespace=self.namespace_of,
            )
            self.index = self.kv_events.index  # the events' index over the gateway's
            self.observers.append(SettleOnOutcome(self.kv_events.settle, self.kv_events.reject))
        await self.flow.start()
        if self.fleet_mode is not None and self.flow.config.enabled:
            fleet_mode = self.fleet_mode
            self.flow_share = UsageShare(
                self.flow,
                lambda: fleet_mode.redis,
                self.config.redis_prefix,
                lambda: self.fleet.models() if self.fleet is not None else (),
                self.config.sync_interval_s,
            )
            await self.flow_share.start()
        for r in self.fleet.replicas.values():
            await self._apply_capacity(r)

    async def _load_models(self) -> None:
        """Build the registry from what the replicas reported and load every model's
        tokenizer (start-up: a contradicted block size is refused here, in one line)."""
        assert self.fleet is not None
        loop = asyncio.get_running_loop()
        self.models.refresh(self.fleet.replicas.values())
        if self.models.refused:
            raise SystemExit(f"prefix-router: {self.models.refused}")
        for name in self.models.unloaded():
            entry = await loop.run_in_executor(self.executor, self.models.load, name)
            self._model_loaded(entry)
        self._models_ready = self.models.started = True
        if not self.models.entries and self.renderer is None:
            # No replica reported a model: --tokenizer, or the one clear line that says why not.
            self.renderer = await loop.run_in_executor(
                self.executor,
                load_renderer,
                self.config.tokenizer,
                None,
                self.config.max_prompt_chars,
            )
            self.models.injected = self.renderer
        if self.renderer is not None:
            await loop.run_in_executor(self.executor, self.renderer.max_chars_per_token)
        default = self.models.default()
        if default is not None:
            self.block_size = default.block_size
            if self.renderer is None:
                self.renderer = default.renderer  # diagnostics decode with the default's
        self._describe_models()

    def _describe_models(self) -> None:
        """The start-up summary's tokenizer and block-size lines (router/startup.py)."""
        entries = sorted(self.models.entries.values(), key=lambda e: e.name)
        if not entries:
            if self.renderer is not None and self.config.tokenizer:
                self.tokenizer_source = tokenizer_source(self.config.tokenizer, None)
            return
        sources = {
            "replicas": "reported by the replicas in vllm:cache_config_info",
            "config": "models: in the config",
            "flag": "--block-size",
            "default": "the default: no replica reported vllm:cache_config_info",
        }

        def tokenizer_of(e: ModelEntry) -> str:
            if e.renderer is None:
                return "none found: matched by a text prefix"
            if e.tokenizer_origin == "injected":
                return "given by the caller"
            if e.tokenizer_origin == "bundled":
                return f"the bundled one for {e.name} ({e.tokenizer})"
            return f"{e.tokenizer} ({e.tokenizer_origin})"

        if len(entries) == 1:
            (e,) = entries
            self.tokenizer_source = tokenizer_of(e)
            self.block_size_source = sources[e.block_size_origin]
            return
        self.tokenizer_source = "; ".join(f"{e.name}: {tokenizer_of(e)}" for e in entries)
        self.block_size_source = "; ".join(
            f"{e.name}: {e.block_size}, {sources[e.block_size_origin]}" for e in entries
        )

    def _model_loaded(self, entry: ModelEntry) -> None:
        if entry.renderer is not None:
            # The longest token (check_fits' bound) scans the vocabulary once: not on a request.
            entry.renderer.max_chars_per_token()
        self.metrics.model_info.labels(
            entry.name, entry.basis, entry.tokenizer_origin, str(entry.block_size)
        ).set(1)

    def block_size_of(self, replica: str) -> int:
        """The block size of the model ``replica`` serves (KV events are checked against it)."""
        entry = self.models.entry_of_replica(replica)
        return entry.block_size if entry is not None else self.block_size

    def namespace_of(self, replica: str) -> str | None:
        """The index namespace of the model ``replica`` serves (router/models/)."""
        entry = self.models.entry_of_replica(replica)
        if entry is not None:
            return entry.namespace
        default = self.models.default()
        return default.namespace if default is not None else None

    def refresh_models(self) -> None:
        """Replicas came, went or reported: rebuild the registry, and load a new model's
        tokenizer off the event loop (its requests use the text prefix until it is in)."""
        if self.fleet is None:
            return
        new = self.models.refresh(self.fleet.replicas.values())
        if self._models_ready:  # during start-up, _load_models loads them
            for name in new:
                self.spawn(self._load_later(name))

    async def _load_later(self, name: str) -> None:
        entry = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.models.load, name
        )
        self._model_loaded(entry)

    async def _wait_for_a_model(self) -> None:
        """With no tokenizer configured the gateway renders with the models the replicas
        report: wait (bounded) for one to come up, as replicas started alongside take seconds."""
        assert self.fleet is not None
        if self.config.tokenizer or self.renderer is not None or self.fleet.base_model():
            return  # a model coming up later joins the registry then
        states = "; ".join(
            f"{r.url}: {'up' if r.healthy else r.health_error or 'not checked yet'}"
            for r in self.fleet.replicas.values()
        )
        log.info(
            "waiting up to %gs for a replica to report its model at /v1/models (no --tokenizer "
            "given; pass one to start without waiting): %s",
            self.config.startup_wait_s,
            states or "no replicas yet",
        )
        # The fleet's health loop probes the replicas and fetches their models.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._model_reported.wait(), self.config.startup_wait_s)

    async def _on_discovered(self, urls: list[str]) -> None:
        assert self.fleet is not None
        await self.fleet.set_urls(urls)
        for r in self.fleet.replicas.values():
            await self._apply_capacity(r)
        self.sync_ring()
        self.refresh_models()

    async def stop(self) -> None:
        self.draining = True
        self.json_check.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        await self.flow.stop()
        if self.flow_share is not None:
            await self.flow_share.stop()
        if self.fleet_mode is not None:
            await self.fleet_mode.stop()
        if self.fleet:
            await self.fleet.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.index.close()
        if self.fleet_mode is not None:
            await self.fleet_mode.close()
        if self.session:
            await self.session.close()
        self.upstream.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def sync_ring(self) -> None:
        """The ring holds the replicas some gateway sees healthy (fleet mode: the same set on
        every gateway, so cold prefixes land alike); routing still skips what this gateway
        sees down."""
        assert self.fleet is not None
        members = self.fleet_mode.members if self.fleet_mode is not None else None
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
        if event == "models" and self.fleet is not None and self.fleet.base_model():
            self._model_reported.set()
        if self.kv_events is not None:  # a health gap may hide a restart from the stream
            self.kv_events.on_fleet_event(replica.url, event)
        if event in ("removed", "restarted"):
            await self.index.drop_replica(replica.url)
        if event == "capacity":
            await self._apply_capacity(replica)
        if event == "ejected":
            self.metrics.ejections.labels(replica.url, replica.ejection_reason or "").inc()
        self.sync_ring()
        if event in ("models", "capacity", "removed", "healthy"):
            self.refresh_models()
        for listener in list(self.fleet_listeners):
            await listener(replica, event)

    @property
    def sync(self) -> FleetSync | None:
        """Fleet mode's load and membership sync (None on a standalone gateway)."""
        return self.fleet_mode.sync if self.fleet_mode is not None else None

    # -- the request path -------------------------------------------------------------------
    async def prepare(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        request_id: str,
        tenant: str | None = None,
        lazy: bool = False,
    ) -> RoutedRequest:
        """Identify the tenant, parse, apply the salt policy, tokenize and hash. Needs no
        replica: ``prefix-router explain`` runs it offline. ``tenant``: already identified
        (from the headers, before the body was read). ``lazy``: a live request may come back
        as a head whose tail is still being tokenized (router/lazy_tail.py)."""
        if tenant is None:
            tenant = self.tenancy.identify(headers)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        token_ids: Sequence[int] | Head
        if len(raw) > LARGE_BODY_BYTES:
            # Parsing, normalising and rendering a big body is pure Python: in a thread the
            # interpreter hands the event loop the GIL every few ms, so /health and other
            # requests keep being answered meanwhile.
            admitted, token_ids = await loop.run_in_executor(
                self.executor, self._admit_and_tokenize, raw, endpoint, tenant
            )
        else:
            admitted = self._admit(raw, endpoint, tenant)
            renderer = admitted.entry.renderer if admitted.entry is not None else None
            try:
                if renderer is None:  # no tokenizer for this model: the text prefix
                    token_ids = self._tokenize(admitted)
                else:
                    # Cached segments cost microseconds: tokenize in place, and hand a prompt
                    # with a lot of new text to a thread (the Rust tokenizer releases the GIL).
                    with renderer.inline(self._loop_encode_chars(renderer)):
                        if lazy and self.lazy_tail:
                            token_ids = self._tokenize_lazy(admitted, renderer)
                        else:
                            token_ids = self._tokenize(admitted)
            except NeedsThread:
                token_ids = await loop.run_in_executor(self.executor, self._tokenize, admitted)
        body, salt, entry = admitted.body, admitted.salt, admitted.entry
        assert entry is not None
        head, ids = (token_ids, token_ids.ids) if isinstance(token_ids, Head) else (None, token_ids)
        hashes = self._hashes(ids, admitted.lora, salt.salt, entry)
        extras: dict[str, Any] = {
            "raw": raw if body is admitted.client_body else None,
            "model_entry": entry,
        }
        if head is not None and entry.renderer is not None:  # the rest: once it is on its way
            finish = functools.partial(self._finish, head, salt.salt, entry.renderer)
            begin = functools.partial(loop.run_in_executor, self.executor, finish)
            limit = self.config.max_hashed_blocks
            capped = limit is not None and len(hashes) >= limit
            inline = finish if self._tail_inline(head, entry.renderer) else None
            extras["tail"] = lazy_tail.Tail(begin, len(hashes), capped, inline)
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
            token_ids=ids,
            block_size=entry.block_size,
            block_hashes=hashes,
            cache_salt=salt.salt,
            lora=admitted.lora,
            salt_policy=salt.policy,
            app_label=app_label[:64] if app_label else None,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            tail_tokens=head.estimated_tokens() if head is not None else 0,
            extras=extras,  # "raw": unchanged bodies are forwarded as the client's own bytes
        )

    async def parse_json(self, raw: bytes) -> dict[str, Any]:
        """``raw`` parsed as a JSON object (a 400 otherwise); a large body off the loop."""
        if len(raw) > LARGE_BODY_BYTES:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, parse_json_object, raw)
        return parse_json_object(raw)

    def _hashes(
        self, token_ids: Sequence[int], lora: str | None, salt: str | None, entry: ModelEntry
    ) -> list[int]:
        # The model's own block size, and its namespace: no two models share an index key.
        return self.chain_cache.block_hashes(
            token_ids,
            entry.block_size,
            cache_salt=salt,
            lora=lora,
            max_blocks=self.config.max_hashed_blocks,
            namespace=entry.namespace,
        )

    @staticmethod
    def _loop_encode_chars(renderer: Renderer) -> int:
        return renderer.loop_encode_chars(INLINE_UNCACHED_CHARS)

    def _lazy_min_rest(self, renderer: Renderer) -> int:
        """Below this much text from the first new segment on, a head is not worth its
        overhead (a second pass, the hand-off, ~0.2 ms a request): with fastokens, the rest
        the loop would encode in place anyway; with Hugging Face's BPE (~2.5 ms per 1,000
        tokens), any rest."""
        return self._loop_encode_chars(renderer) if renderer.fast_encoder else 0

    def _tail_inline(self, head: Head, renderer: Renderer) -> bool:
        """Whether a head's rest is small enough to tokenize on the loop once it is sent."""
        return head.rest_chars <= self._loop_encode_chars(renderer)

    @staticmethod
    def _finish(head: Head, salt: str | None, renderer: Renderer) -> Sequence[int]:
        """A head's full ids, in a worker thread (the segment cache scoped as in prepare)."""
        with renderer.cache_scope(salt):
            return head.finish()

    async def complete(self, rr: RoutedRequest) -> RoutedRequest:
        """``rr`` with every id and block hash: waits for a lazy head's tail."""
        tail = lazy_tail.tail_of(rr)
        if tail is None or tail.full is not None:
            return lazy_tail.latest(rr)
        if tail.finish_inline is not None and not tail.started:
            ids = tail.finish_inline()  # a small rest: no thread hand-off
        else:
            ids = await asyncio.shield(tail.ids())
        if tail.full is None:
            head = rr.token_ids
            if ids[: len(head)] != head:  # cannot happen (tests/test_lazy_tail.py): stay safe
                log.error("lazy tail: a head was not a prefix of its prompt; lazy tail off")
                self.lazy_tail = False
            hashes = self._hashes(ids, rr.lora, rr.cache_salt, rr.extras["model_entry"])
            tail.full = dataclasses.replace(rr, token_ids=ids, block_hashes=hashes, tail_tokens=0)
            for hook in tail.on_full:
                hook(tail.full)
        return tail.full

    def route_of(self, name: Any) -> Route:
        """The registry entry a body's ``model`` names (aliases applied), or the error that
        says why none serves it. Offline (no fleet): the renderer handed in, for any name."""
        name = name if isinstance(name, str) else None
        if self.fleet is None:
            name = name or self.models.offline_default()
            return self.models.offline(name, self.renderer, self.block_size)
        route = self.models.resolve(name)
        if route is None:
            self.serving(self.models.alias(name) if name else (self.fleet.base_model() or ""))
            self.refresh_models()  # served, but the registry has not seen it yet
            route = self.models.resolve(name)
        if route is None:  # not in the registry yet: by load and the text prefix meanwhile
            return self.models.offline(name or "", None, self.block_size)
        return route

    def _admit(self, raw: bytes, endpoint: Endpoint, tenant: str) -> _Admitted:
        """Parse the body, check that some replica serves its model, and decide its salt:
        everything that comes before tokenizing. A request for a model nobody serves is
        refused here, so it cannot be used to time the tokenizer's caches for free."""
        body = client_body = parse_body(raw, endpoint, self.limits)
        route = self.route_of(body.get("model"))
        model, lora, entry = route.model, route.lora, route.entry
        if self.fleet is not None:
            self.serving(model, entry=entry, lora=lora)
        if route.alias_of is not None:  # the replicas know the served name only
            body = dict(body)
            body["model"] = model
        if self.fleet is not None and entry.renderer is not None:
            # What cannot fit the context is refused before rendering.
            card = self.fleet.card(model) or {}
            check_fits(body, card.get("max_model_len"), entry.renderer.max_chars_per_token())
        chat = to_chat(endpoint, body)
        salt = self.tenancy.salt(
            tenant, body.get("cache_salt"), chat.get("messages") if chat is not None else None
        )
        if salt.salt != body.get("cache_salt"):
            body = dict(body)
            if salt.salt is None:
                body.pop("cache_salt", None)
            else:
                body["cache_salt"] = salt.salt
            if endpoint == "chat":
                chat = body
        return _Admitted(endpoint, body, client_body, model, lora, salt, chat, entry)

    def _tokenize_lazy(self, admitted: _Admitted, renderer: Renderer) -> Sequence[int] | Head:
        """``_tokenize``, or for a chat prompt with new text a head (router/lazy_tail.py)."""
        if admitted.chat is None:
            return self._tokenize(admitted)
        assert admitted.entry is not None
        with renderer.cache_scope(admitted.salt.salt):
            return renderer.chat_head(
                admitted.chat, admitted.entry.block_size, self._lazy_min_rest(renderer)
            )

    def _tokenize(self, admitted: _Admitted) -> Sequence[int]:
        assert admitted.entry is not None
        renderer = admitted.entry.renderer
        if renderer is None:  # router/models/fallback.py: labelled text_prefix
            return fallback.prompt_ids(admitted.chat, admitted.body)
        # The segment cache is scoped like the replicas' prefix caches: by the salt sent;
        # new text is encoded within a CPU budget, and stops once it cannot fit the context.
        budget = segments.budget(self.config.max_tokenize_cpu_s, self._max_prompt_tokens(admitted))
        with renderer.cache_scope(admitted.salt.salt), budget:
            if admitted.chat is not None:
                return renderer.chat_ids(admitted.chat)
            # Honours add_special_tokens and truncation; a batch routes on its first prompt.
            return renderer.completion_request_ids(admitted.body)[0]

    def _max_prompt_tokens(self, admitted: _Admitted) -> int | None:
        """The model's context (from the replicas' model cards): a longer prompt is refused
        anyway. None when unknown, or when the request asks vLLM to truncate it."""
        chat = admitted.chat or {}
        if self.fleet is None or "truncate_prompt_tokens" in {**admitted.body, **chat}:
            return None
        n = (self.fleet.card(admitted.model) or {}).get("max_model_len")
        if n is None and admitted.entry is not None:
            n = admitted.entry.max_model_len  # an adapter's card has none: its base's
        return n if type(n) is int and n > 0 else None

    def _admit_and_tokenize(
        self, raw: bytes, endpoint: Endpoint, tenant: str
    ) -> tuple[_Admitted, Sequence[int]]:
        admitted = self._admit(raw, endpoint, tenant)
        return admitted, self._tokenize(admitted)

    def serving(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        entry: ModelEntry | None = None,
        lora: str | None = None,
    ) -> list[Replica]:
        """The replicas that can take a request for ``model`` (those of its registry entry's
        routed group: replicas kept apart only when none of those can), or the error that
        says why none can. An adapter no replica has, where runtime loading is allowed: its
        base model's replicas (the chosen one loads it, ``ensure_adapter``)."""
        assert self.fleet is not None
        replicas = [r for r in self.fleet.serving(model) if r.url not in exclude]
        if not replicas and lora is not None and self._may_load(lora):
            base = entry.name if entry is not None else ""
            replicas = [r for r in self.fleet.serving(base) if r.url not in exclude]
        if entry is not None and entry.replicas:
            routed = set(entry.replicas)
            replicas = [r for r in replicas if r.url in routed] or replicas
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

    def _flow_replicas(self, model: str) -> list[Replica]:
        return self.fleet.serving(model) if self.fleet is not None else []

    def flow_request(self, rr: RoutedRequest, headers: Mapping[str, str]) -> FlowRequest:
        """What flow control reads of a prepared request: its tenant's weight and band from
        the tenancy table, its session where the client names one."""
        return FlowRequest(
            model=rr.model,
            tenant=rr.tenant,
            session=session_of(rr.endpoint, rr.body, headers, self.response_chains),
            settings=self.tenancy.policy_of(rr.tenant).flow,
            prompt_tokens=rr.num_tokens,
            max_tokens=rr.max_tokens,
            stream=rr.stream,
        )

    async def admit(self, rr: RoutedRequest, headers: Mapping[str, str]) -> Ticket:
        """Flow control's ticket for ``rr`` (at once unless the fleet is saturated), or a
        429 ``APIError``."""
        return await self.flow.admit(self.flow_request(rr, headers), lambda: self.uncached(rr))

    async def uncached(self, rr: RoutedRequest) -> tuple[int, tuple[str, ...]]:
        """Prompt tokens the best-placed replica would prefill, and the replicas holding that
        much: the scheduler's prefix match (the index lookup a decision makes), without a
        decision."""
        replicas = self.fleet.serving(rr.model) if self.fleet is not None else []
        if not replicas or not self.policy.uses_index:
            return rr.num_tokens, ()
        matches = await self.index.match(rr.block_hashes, [r.url for r in replicas])
        best = min(
            max(matches.values(), default=0), blocks.cacheable_blocks(rr.num_tokens, rr.block_size)
        )
        holders = tuple(url for url, m in matches.items() if best and min(m, best) == best)
        return max(0, rr.num_tokens - best * rr.block_size), holders

    async def decide(self, rr: RoutedRequest, exclude: frozenset[str] = frozenset()) -> Decision:
        t0 = time.perf_counter()
        entry = rr.extras.get("model_entry")
        replicas = self.serving(rr.model, exclude, entry, rr.lora)
        if pinned := rr.extras.get("pinned_replica"):  # holds the state the request names
            replicas = [r for r in replicas if r.url == pinned] or replicas
        urls = [r.url for r in replicas]
        rr = lazy_tail.latest(rr)
        matches = await self.index.match(rr.block_hashes, urls) if self.policy.uses_index else {}
        tail = lazy_tail.tail_of(rr)
        if tail is not None and tail.full is None:
            on_head = tail.decides(matches)
            self.metrics.lazy_tail.labels("head" if on_head else "full").inc()
            if not on_head:  # a match reaches the head's end: wait for the rest (exact)
                rr = await self.complete(rr)
                if self.policy.uses_index:
                    matches = await self.index.match(rr.block_hashes, urls)
        decision = self.policy.choose(rr, [r.candidate(matches.get(r.url, 0)) for r in replicas])
        if rr.lora is not None:
            chosen = self.fleet.replicas.get(decision.replica) if self.fleet else None
            if chosen is not None and not chosen.has_model(rr.lora):
                rr.extras["adapter_load"] = {
                    "replica": decision.replica,
                    "adapter": rr.lora,
                    "path": self.models.loadable_adapters[rr.lora][1],
                }
            else:
                rr.extras.pop("adapter_load", None)
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        return decision

    def _may_load(self, adapter: str) -> bool:
        return self.config.lora_runtime_loading and adapter in self.models.loadable_adapters

    async def ensure_adapter(self, rr: RoutedRequest, replica: Replica) -> None:
        """Load the request's LoRA adapter on ``replica`` first, when ``decide`` chose one
        without it (vLLM's /v1/load_lora_adapter). A failure is the replica's: retried
        elsewhere as any failure before the first byte."""
        load = rr.extras.get("adapter_load")
        if load is None or load["replica"] != replica.url or replica.has_model(load["adapter"]):
            return
        assert self.session is not None and self.fleet is not None
        entry = rr.extras.get("model_entry")
        model = entry.name if entry is not None else ""
        headers = dict(self.fleet.headers)
        payload = {"lora_name": load["adapter"], "lora_path": load["path"]}
        try:
            async with self.session.post(
                replica.url + "/v1/load_lora_adapter",
                json=payload,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.first_byte_timeout_floor_s),
            ) as resp:
                text = await resp.text()
                ok = resp.status == 200 or "already been loaded" in text
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, text = False, f"{type(e).__name__}: {e}"
        self.metrics.adapter_loads.labels(model, load["adapter"], "ok" if ok else "failed").inc()
        if not ok:
            log.warning(
                "loading LoRA adapter %s on %s failed: %s", load["adapter"], replica.url, text[:200]
            )
            raise UpstreamUnavailable(f"load_lora_adapter: {text[:80]}")
        log.info("loaded LoRA adapter %s on %s", load["adapter"], replica.url)
        replica.models[load["adapter"]] = model
        self.refresh_models()

    async def forget_unsent(self, rr: RoutedRequest, decision: Decision) -> None:
        """The replica failed before computing the blocks recorded for it: take back what
        was new to it."""
        rr = await self.complete(rr)  # a retry: rare, and the tail must not re-record
        if (tail := lazy_tail.tail_of(rr)) is not None:
            tail.taken_back.add(decision.replica)
        unsent = rr.block_hashes[decision.matched_blocks :]
        if self.fleet_mode is None:
            await self.index.forget(decision.replica, unsent)
        else:
            self.spawn(self.index.forget(decision.replica, unsent))

    async def record_placement(self, rr: RoutedRequest, decision: Decision) -> None:
        """The chosen replica will hold the prompt's blocks. Runs while the request is on
        its way (``UpstreamPool.post``), and before anything else runs on this loop. A lazy
        head's blocks are recorded now, the full prompt's once its tail is tokenized; a
        small tail is tokenized here, now that the replica has the request, and recorded
        once."""
        rr = lazy_tail.latest(rr)
        if (tail := lazy_tail.tail_of(rr)) is not None and tail.finish_inline is not None:
            rr = await self.complete(rr)
        if lazy_tail.pending(rr):
            self.spawn(self._record_tail(rr, decision))
        if self.fleet_mode is None:
            await self.index.record(decision.replica, rr.block_hashes)
        else:  # a Redis write stays off the request's critical path
            self.spawn(self.index.record(decision.replica, rr.block_hashes))
        self.metrics.placed(decision)

    async def _record_tail(self, rr: RoutedRequest, decision: Decision) -> None:
        full = await self.complete(rr)
        tail = lazy_tail.tail_of(rr)
        if tail is None or decision.replica not in tail.taken_back:
            await self.index.record(decision.replica, full.block_hashes)

    def count_prompt(self, rr: RoutedRequest) -> None:
        """The prompt-tokens metric, with the full count (a lazy head's once it is known)."""
        tail = lazy_tail.tail_of(rr)
        if tail is not None and tail.full is None:
            tail.on_full.append(self.count_prompt)
        else:
            tokens = lazy_tail.latest(rr).num_tokens
            self.metrics.child(self.metrics.prompt_tokens, rr.tenant).inc(tokens)

    def learn(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        """Compare the prediction with what the replica reports, and correct the index (a
        lazy head's once its tail is tokenized: observers see the whole prompt)."""
        if lazy_tail.pending(rr):
            self.spawn(self._learn_later(rr, decision, outcome))
        else:
            self._learn(lazy_tail.latest(rr), decision, outcome)

    async def _learn_later(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        self._learn(await self.complete(rr), decision, outcome)

    def _learn(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        outcome_label = (
            "ok"
            if outcome.status < 400 and outcome.complete
            else (f"http_{outcome.status}" if outcome.status >= 400 else "broken")
        )
        self.metrics.child(
            self.metrics.requests, decision.replica, decision.policy, outcome_label
        ).inc()
        self.metrics.child(self.metrics.upstream_ttft, decision.replica).observe(
            outcome.first_byte_s
        )
        uncached = max(0, rr.num_tokens - decision.matched_blocks * rr.block_size)
        replica = self.fleet.replicas.get(decision.replica) if self.fleet else None
        if replica is not None and is_wait_sample(rr.stream, outcome.status, uncached):
            replica.ttft.observe(outcome.first_byte_s)
        predicted = decision.matched_blocks * rr.block_size
        self.metrics.child(self.metrics.predicted_cached_tokens, rr.tenant).inc(predicted)
        entry = rr.extras.get("model_entry")
        if entry is not None:
            self._learn_model(entry, predicted, outcome.cached_tokens)
        for observer in self.observers:
            observer.observe(rr, decision, outcome)
        if outcome.cached_tokens is None:
            return
        reported = outcome.cached_tokens
        self.metrics.child(self.metrics.reported_cached_tokens, rr.tenant).inc(reported)
        self.metrics.prediction_error.observe(predicted - reported)
        precise = self.kv_events is not None and self.kv_events.is_up(decision.replica)
        if reported == 0 and decision.matched_blocks >= 2 and not precise:  # events know
            # The replica held none of what we believed it held: its cache was lost (restart,
            # reset) behind our back. Forget everything we believed about it but this request.
            log.info(
                "replica %s reported no cached tokens where %d were predicted; resetting its index",
                decision.replica,
                predicted,
            )
            self.spawn(self._reset_replica(decision.replica, rr.block_hashes))

    def _learn_model(self, entry: ModelEntry, predicted: int, reported: int | None) -> None:
        """Per-model counters and the drift watch (router/models/drift.py)."""
        m = self.metrics
        m.child(m.model_requests, entry.name, entry.basis).inc()
        m.child(m.model_predicted_cached_tokens, entry.name).inc(predicted)
        if reported is None:
            return
        m.child(m.model_reported_cached_tokens, entry.name).inc(reported)
        if entry.basis != "tokens":  # a text prefix approximates: no drift to speak of
            return
        change = entry.drift.observe(predicted, reported)
        m.child(m.model_drift, entry.name).set(entry.drift.ratio())
        if change is None:
            return
        m.child(m.model_drifting, entry.name).set(1 if change else 0)
        if change:
            log.warning(
                "model %s: predictions run above what its replicas report (%.0f%% of the "
                "predicted cached tokens of its last %d requests unconfirmed): do the replicas "
                "use another chat template, tokenizer or block size? (tokenizer: %s %s)",
                entry.name,
                100 * entry.drift.ratio(),
                len(entry.drift.samples),
                entry.tokenizer_origin,
                entry.tokenizer,
            )
        else:
            log.info("model %s: predictions agree with its replicas again", entry.name)

    async def _reset_replica(self, url: str, keep: list[int]) -> None:
        await self.index.drop_replica(url)
        if self.fleet and url in self.fleet.replicas:
            await self._apply_capacity(self.fleet.replicas[url])
        await self.index.record(url, keep)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


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
