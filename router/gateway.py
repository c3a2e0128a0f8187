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
from router.forward import Outcome, header_allow_list
from router.index import MemoryIndex, PrefixIndex
from router.json_check import JsonCheck
from router.kv_events import KVEventSubscriber, SettleOnOutcome, start_for
from router.limits import BodyLimits, check_fits
from router.loading import load_renderer, tokenizer_source
from router.metrics import Metrics
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
        if self.renderer is None:
            await self._wait_for_a_model()  # fleet mode's keys and the block size need it too
        if self.config.redis_url:
            self.fleet_mode = FleetMode(
                self.config, self.fleet, self.metrics, self.spawn, self.sync_ring
            )
            self.index = await self.fleet_mode.start()
        self.sync_ring()
        if self.config.block_size is None:
            reported = self.fleet.block_size()
            self.block_size = reported or DEFAULT_BLOCK_SIZE
            self.block_size_source = (
                "reported by the replicas in vllm:cache_config_info"
                if reported
                else "the default: no replica reported vllm:cache_config_info"
            )
        if self.config.kv_events:
            self.kv_events = await start_for(
                self.config,
                self.fleet,
                self.index,
                lambda: self.block_size,
                self.metrics,
                self.fleet_mode,
            )
            self.index = self.kv_events.index  # the events' index over the gateway's
            self.observers.append(SettleOnOutcome(self.kv_events.settle, self.kv_events.reject))
        for r in self.fleet.replicas.values():
            await self._apply_capacity(r)
        if self.renderer is None:
            self.renderer = await asyncio.get_running_loop().run_in_executor(
                self.executor,
                load_renderer,
                self.config.tokenizer,
                self.fleet.base_model(),
                self.config.max_prompt_chars,
            )
            self.tokenizer_source = tokenizer_source(self.config.tokenizer, self.fleet.base_model())
        # The longest token (check_fits' bound) scans the vocabulary once: not on a request.
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.renderer.max_chars_per_token
        )

    async def _wait_for_a_model(self) -> None:
        """With no tokenizer configured the gateway renders with the model a replica reports:
        wait (bounded) for one to come up, as replicas started alongside take seconds."""
        assert self.fleet is not None
        if self.config.tokenizer or self.fleet.base_model():
            return
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

    async def stop(self) -> None:
        self.draining = True
        self.json_check.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
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
            try:
                # Cached segments cost microseconds: tokenize in place, and hand a prompt with
                # a lot of new text to a thread (the Rust tokenizer releases the GIL there).
                with self._renderer().inline(self._loop_encode_chars()):
                    if lazy and self.lazy_tail:
                        token_ids = self._tokenize_lazy(admitted)
                    else:
                        token_ids = self._tokenize(admitted)
            except NeedsThread:
                token_ids = await loop.run_in_executor(self.executor, self._tokenize, admitted)
        body, salt = admitted.body, admitted.salt
        head, ids = (token_ids, token_ids.ids) if isinstance(token_ids, Head) else (None, token_ids)
        hashes = self._hashes(ids, admitted.lora, salt.salt)
        extras: dict[str, Any] = {"raw": raw if body is admitted.client_body else None}
        if head is not None:  # the rest is tokenized once the request is on its way
            finish = functools.partial(self._finish, head, salt.salt)
            begin = functools.partial(loop.run_in_executor, self.executor, finish)
            limit = self.config.max_hashed_blocks
            capped = limit is not None and len(hashes) >= limit
            inline = finish if self._tail_inline(head) else None
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
            block_size=self.block_size,
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

    def _hashes(self, token_ids: Sequence[int], lora: str | None, salt: str | None) -> list[int]:
        return self.chain_cache.block_hashes(
            token_ids,
            self.block_size,
            cache_salt=salt,
            lora=lora,
            max_blocks=self.config.max_hashed_blocks,
        )

    def _loop_encode_chars(self) -> int:
        return self._renderer().loop_encode_chars(INLINE_UNCACHED_CHARS)

    def _lazy_min_rest(self) -> int:
        """Below this much text from the first new segment on, a head is not worth its
        overhead (a second pass, the hand-off, ~0.2 ms a request): with fastokens, the rest
        the loop would encode in place anyway; with Hugging Face's BPE (~2.5 ms per 1,000
        tokens), any rest."""
        return self._loop_encode_chars() if self._renderer().fast_encoder else 0

    def _tail_inline(self, head: Head) -> bool:
        """Whether a head's rest is small enough to tokenize on the loop once it is sent."""
        return head.rest_chars <= self._loop_encode_chars()

    def _finish(self, head: Head, salt: str | None) -> Sequence[int]:
        """A head's full ids, in a worker thread (the segment cache scoped as in prepare)."""
        with self._renderer().cache_scope(salt):
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
            hashes = self._hashes(ids, rr.lora, rr.cache_salt)
            tail.full = dataclasses.replace(rr, token_ids=ids, block_hashes=hashes, tail_tokens=0)
            for hook in tail.on_full:
                hook(tail.full)
        return tail.full

    def _renderer(self) -> Renderer:
        assert self.renderer is not None
        return self.renderer

    def _admit(self, raw: bytes, endpoint: Endpoint, tenant: str) -> _Admitted:
        """Parse the body, check that some replica serves its model, and decide its salt:
        everything that comes before tokenizing. A request for a model nobody serves is
        refused here, so it cannot be used to time the tokenizer's caches for free."""
        body = parse_body(raw, endpoint, self.limits)
        model = body.get("model")
        fleet = self.fleet
        if model is None:
            model = (fleet.base_model() if fleet else None) or ""
        if fleet is not None:
            self.serving(model)
        lora = model if fleet and fleet.adapter_parent(model) else None
        if fleet is not None:  # what cannot fit the context is refused before rendering
            card = fleet.card(model) or {}
            check_fits(body, card.get("max_model_len"), self._renderer().max_chars_per_token())
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

    def _tokenize_lazy(self, admitted: _Admitted) -> Sequence[int] | Head:
        """``_tokenize``, or for a chat prompt with new text a head (router/lazy_tail.py)."""
        if admitted.chat is None:
            return self._tokenize(admitted)
        renderer = self._renderer()
        with renderer.cache_scope(admitted.salt.salt):
            return renderer.chat_head(admitted.chat, self.block_size, self._lazy_min_rest())

    def _tokenize(self, admitted: _Admitted) -> Sequence[int]:
        renderer = self._renderer()
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
        n = (self.fleet.models().get(admitted.model) or {}).get("max_model_len")
        return n if type(n) is int and n > 0 else None

    def _admit_and_tokenize(
        self, raw: bytes, endpoint: Endpoint, tenant: str
    ) -> tuple[_Admitted, Sequence[int]]:
        admitted = self._admit(raw, endpoint, tenant)
        return admitted, self._tokenize(admitted)

    def serving(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Replica]:
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
        replicas = self.serving(rr.model, exclude)
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
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        return decision

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
