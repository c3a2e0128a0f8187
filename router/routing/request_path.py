"""The request path of one gateway, up to and after forwarding:

    prepare (parse -> tenancy -> prompt -> blocks) -> plan (schedule) -> [exchange] -> learn

``prepare`` and ``plan`` (``decide``: its one leg's decision) need no HTTP request: the live
handlers (router/http/handlers.py) and the explain endpoint both call them, so nothing is
re-implemented for explaining. What the
path needs of a request's model (its renderer, block size and replicas) comes from
``served`` and ``serving``; the fleet, index and ring from ``FleetWiring`` (router/fleet/wiring.py).
A routed request's life after ``prepare`` is its exchange (router/routing/exchange.py), the HTTP
surface router/http/handlers.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.config import Config
from router.core import blocks
from router.core.errors import APIError, bad_request, clip
from router.core.record import record
from router.fleet.replicas import Replica, Role
from router.fleet.wiring import FleetWiring
from router.flow.controller import Estimate, FlowConfig, FlowController, FlowRequest, Ticket
from router.flow.sessions import ResponseChains, session_of
from router.flow.settings import FlowSettings
from router.intake import costs
from router.intake.parse import forwarded_bytes, parse_body, parse_json_object
from router.intake.routed_request import Endpoint, RoutedRequest, Tail
from router.intake.shapes import BodyLimits, check_fits
from router.models import ModelEntry, ModelRegistry, Route, fallback
from router.models.upkeep import ModelUpkeep
from router.prompt import NeedsThread, Renderer, scope
from router.prompt.lazy import Head
from router.routing import lazy_tail
from router.routing.learning import Learner, Observer
from router.routing.plan import Leg, Plan
from router.schedule import Decision, Pipeline, from_config
from router.telemetry.metrics import Metrics
from router.tenancy.tenants import SaltDecision, Tenancy
from router.upstream.proxy import Outcome

log = logging.getLogger("prefix_router")

DEFAULT_BLOCK_SIZE = 16
APP_HEADER = "X-Prefix-Router-App"  # optional client label that diagnostics group by
# More new text than this is tokenized in a worker thread (~1 ms with Hugging Face's BPE;
# Renderer.loop_encode_chars raises it where a thread cannot help).
INLINE_UNCACHED_CHARS = 4096
LARGE_BODY_BYTES = 256 * 1024  # bodies beyond this are parsed and rendered in a thread

# The chat body vLLM renders for another API's body (router/api/convert.py has them): the
# API layer hands them in, so this layer never imports it.
ChatConverter = Callable[[dict[str, Any]], dict[str, Any]]
Spawn = Callable[[Coroutine[Any, Any, Any]], None]


# The APIs whose vLLM request takes ``priority`` (chat, completions, Responses in v0.34).
BAND_PRIORITY_APIS = frozenset({"chat", "completions", "responses"})


@record
class _Admitted:
    """A parsed request whose model is served and whose salt is decided (read-only)."""

    endpoint: Endpoint
    body: dict[str, Any]  # as it will be forwarded (the salt policy applied)
    client_body: dict[str, Any]  # as the client sent it
    model: str
    lora: str | None
    salt: SaltDecision
    entry: ModelEntry  # the model's registry entry (router/models/)
    chat: dict[str, Any] | None = None  # the chat body rendered, for every API but completions
    # Prompt tokens of a completions batch past its first prompt, once tokenized (filled
    # by ``_tokenize``, which may run in a worker thread: a list it appends to).
    batch: list[int] = dataclasses.field(default_factory=list)


def _loop_encode_chars(renderer: Renderer) -> int:
    return renderer.loop_encode_chars(INLINE_UNCACHED_CHARS)


def _finish(renderer: Renderer, head: Head, salt: str | None) -> Sequence[int]:
    """A head's full ids, in a worker thread (the segment cache scoped as in prepare)."""
    with renderer.cache_scope(salt):
        return head.finish()


class RequestPath:
    """Prepare, decide, record and learn, for every request of one gateway."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        wiring: FleetWiring,
        executor: ThreadPoolExecutor,
        spawn: Spawn,
        renderer: Renderer | None = None,
        converters: Mapping[Endpoint, ChatConverter] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.wiring = wiring
        self.executor = executor
        self.spawn = spawn
        self.tenancy = Tenancy(config)
        self.band_priority = config.flow.flow_band_priority  # vLLM priority from the band
        self.limits = BodyLimits.from_config(config.limits)
        self.renderer = renderer  # --tokenizer's (or one handed in): see ModelRegistry
        self.block_size = config.routing.block_size or DEFAULT_BLOCK_SIZE
        # Per served model: renderer, block size, replicas, drift (router/models/).
        self.models = ModelRegistry(
            config.registry.models,
            config.registry.model_aliases,
            flag_tokenizer=config.routing.tokenizer,
            flag_block_size=config.routing.block_size,
            injected=renderer,
            max_prompt_chars=config.limits.max_prompt_chars,
        )
        # Its owner at run time: refresh, routes, adapters, per-model learning and drift.
        self.upkeep = ModelUpkeep(
            self.models,
            config,
            metrics,
            executor,
            spawn,
            lambda: wiring.opened,
            lambda: wiring.session,
        )
        self.converters = dict(converters or {})
        self.chain_cache = blocks.ChainCache()
        # One scheduling pipeline per replica role, built from the same plugins: only
        # ``both`` (aggregated serving) today; prefill/decode disaggregation adds the others.
        self.pipelines: dict[Role, Pipeline] = {"both": from_config(config.routing, wiring.ring)}
        self.policy: Pipeline = self.pipelines["both"]  # schedule + policy flags
        # Route on a prompt's head and tokenize the rest off the critical path
        # (router/routing/lazy_tail.py), where the policy provably decides the same.
        why_not = lazy_tail.policy_allows(self.policy)
        self.lazy_tail = config.routing.lazy_tail and why_not is None
        if config.routing.lazy_tail and why_not is not None:
            log.info("lazy tail off: %s", why_not)
        self.observers: list[Observer] = []
        # What each answered request teaches (router/routing/learning.py).
        self.learner = Learner(config, metrics, wiring, self.upkeep, self.observers, spawn)
        # Flow control (router/flow/): fair queuing per tenant while the replicas are full.
        self.flow = FlowController(
            FlowConfig.from_config(config.flow), self._flow_replicas, metrics.registry
        )
        self.response_chains = ResponseChains()  # Responses chains as one session each

    def served(self, name: Any) -> Route:
        """The route a body's ``model`` names (router/models/upkeep.py)."""
        return self.upkeep.route(name, self.renderer, self.block_size)

    def _chat_body(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None:
        """The chat body rendered for ``body``; None for completions (a prompt)."""
        if endpoint == "chat":
            return body
        if endpoint == "completions":
            return None
        convert = self.converters.get(endpoint)
        if convert is None:
            raise bad_request(f"this gateway does not serve the {endpoint} API")
        return convert(body)

    async def prepare(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        request_id: str,
        tenant: str | None = None,
        lazy: bool = False,
        limited: bool = False,
    ) -> RoutedRequest:
        """Identify the tenant, parse, apply the salt policy, tokenize and hash. Needs no
        replica: ``prefix-router explain`` runs it offline. ``tenant``: already identified
        (from the headers, before the body was read). ``lazy``: a live request may come back
        as a head whose tail is still being tokenized (router/routing/lazy_tail.py). ``limited``: the
        tenant's rate limits are checked before its prompt is rendered (rpm first, then a
        lower bound of its tokens: ``_precheck``); a live request is counted by ``admit``."""
        if tenant is None:
            tenant = self.tenancy.identify(headers)
        flow = self.tenancy.policy_of(tenant).flow if limited else None
        if flow is not None:
            self.flow.precheck(tenant, flow)  # over its rpm: nothing parsed, nothing rendered
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        token_ids: Sequence[int] | Head
        if len(raw) > LARGE_BODY_BYTES:
            # Parsing, normalising and rendering a big body is pure Python: in a thread the
            # interpreter hands the event loop the GIL every few ms, so /health and other
            # requests keep being answered meanwhile.
            if flow is not None and flow.tpm is not None:  # its floor checked in between
                admitted = await loop.run_in_executor(
                    self.executor, self._admit, raw, endpoint, tenant
                )
                self._precheck(admitted, tenant, flow)
                token_ids = await loop.run_in_executor(self.executor, self._tokenize, admitted)
            else:
                admitted, token_ids = await loop.run_in_executor(
                    self.executor, self._admit_and_tokenize, raw, endpoint, tenant
                )
        else:
            admitted = self._admit(raw, endpoint, tenant)
            if flow is not None and flow.tpm is not None:
                self._precheck(admitted, tenant, flow)
            renderer = admitted.entry.renderer
            try:
                if renderer is None:  # no tokenizer for this model: the text prefix
                    token_ids = self._tokenize(admitted)
                else:
                    # Cached segments cost microseconds: tokenize in place, and hand a prompt
                    # with a lot of new text to a thread (the Rust tokenizer releases the GIL).
                    with renderer.inline(_loop_encode_chars(renderer)):
                        if lazy and self.lazy_tail:
                            token_ids = self._tokenize_lazy(admitted, renderer)
                        else:
                            token_ids = self._tokenize(admitted)
            except NeedsThread:
                token_ids = await loop.run_in_executor(self.executor, self._tokenize, admitted)
        body, salt, entry = admitted.body, admitted.salt, admitted.entry
        head, ids = (token_ids, token_ids.ids) if isinstance(token_ids, Head) else (None, token_ids)
        hashes = self._hashes(ids, admitted.lora, salt.salt, entry)
        tail = None
        if head is not None and entry.renderer is not None:  # the rest: once it is on its way
            finish = functools.partial(_finish, entry.renderer, head, salt.salt)
            begin = functools.partial(loop.run_in_executor, self.executor, finish)
            limit = self.config.routing.max_hashed_blocks
            capped = limit is not None and len(hashes) >= limit
            inline = finish if self._tail_inline(head, entry.renderer) else None
            tail = Tail(begin, len(hashes), capped, inline)
        self.metrics.tokenize_latency.observe(time.perf_counter() - t0)
        limits = admitted.chat if admitted.chat is not None else body
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
            max_tokens=costs.output_limit(limits),
            batch_tokens=sum(admitted.batch),
            sequences=costs.sequences(limits, costs.prompt_count(body)),
            tail_tokens=head.estimated_tokens() if head is not None else 0,
            raw=forwarded_bytes(raw, admitted.client_body, body),
            tail=tail,
            model_entry=entry,
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
        # Ids that start with a prefix state (router/prompt/prefix_state.py) hash only the
        # blocks after its known ones, and leave theirs for the states they created.
        prefix = getattr(token_ids, "prefix", None)
        root = blocks.root_hash(salt, lora, entry.namespace)
        size = entry.block_size
        known = prefix.known_hashes(root, size) if prefix is not None else None
        hashes = self.chain_cache.block_hashes(
            token_ids,
            size,
            cache_salt=salt,
            lora=lora,
            max_blocks=self.config.routing.max_hashed_blocks,
            namespace=entry.namespace,
            known=known,
        )
        if prefix is not None and known is None:
            prefix.keep_hashes(root, size, hashes)
        stored = getattr(token_ids, "stored", ())
        if stored:
            for state in stored:
                state.keep_hashes(root, size, hashes)
            # A new state may hold these ids until it is first used (PrefixState): the ids
            # holding it back would be a cycle, freed only by the garbage collector.
            token_ids.stored = ()  # type: ignore[attr-defined]
        return hashes

    async def complete(self, rr: RoutedRequest) -> RoutedRequest:
        """``rr`` with every id and block hash: waits for a lazy head's tail."""
        tail = rr.tail
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
            assert rr.model_entry is not None
            hashes = self._hashes(ids, rr.lora, rr.cache_salt, rr.model_entry)
            tail.full = dataclasses.replace(rr, token_ids=ids, block_hashes=hashes, tail_tokens=0)
            for hook in tail.on_full:
                hook(tail.full)
        return tail.full

    def _admit(self, raw: bytes, endpoint: Endpoint, tenant: str) -> _Admitted:
        """Parse the body, check that some replica serves its model, and decide its salt:
        everything that comes before tokenizing. A request for a model nobody serves is
        refused here, so it cannot be used to time the tokenizer's caches for free."""
        body = client_body = parse_body(raw, endpoint, self.limits)
        tenancy = self.tenancy
        tenancy.check_fields(tenant, body)
        name = body.get("model")
        self.check_model(tenant, name)  # before its route: no work, no oracle
        route = self.served(name)
        if not name:
            self.check_model(tenant, route.model)  # the default model
        model, lora, entry = route.model, route.lora, route.entry
        fleet = self.wiring.opened
        if fleet is not None and not fleet.serves(model):
            # Refused here if nothing can take it (serving's errors). Some replica serving
            # the model is enough: serving() then has candidates (decide asks it again).
            self.upkeep.serving(model, entry=entry, lora=lora)
        if route.alias_of is not None:  # the replicas know the served name only
            body = dict(body)
            body["model"] = model
        if fleet is not None and entry.renderer is not None:
            # What cannot fit the context is refused before rendering.
            card = fleet.card(model) or {}
            check_fits(body, card.get("max_model_len"), entry.renderer.max_chars_per_token())
        chat = self._chat_body(endpoint, body)
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
        if self.band_priority and endpoint in BAND_PRIORITY_APIS and "priority" not in client_body:
            body = dict(body)
            body["priority"] = tenancy.band_priority(tenant)
            if endpoint == "chat":
                chat = body
        return _Admitted(endpoint, body, client_body, model, lora, salt, entry, chat)

    def _precheck(self, admitted: _Admitted, tenant: str, flow: FlowSettings) -> None:
        """A request its tenant's tpm cannot take now even at its fewest tokens is refused
        before rendering: its prompt's text over the longest string a token stands for
        (router/intake/costs.py ``prompt_floor``), plus every sequence's output limit."""
        renderer = admitted.entry.renderer
        limits = admitted.chat if admitted.chat is not None else admitted.body
        prompt = (
            costs.prompt_floor(limits, renderer.max_chars_per_token())
            if renderer is not None
            else 0
        )
        output = self.flow.expected_output(
            costs.output_limit(limits), costs.sequences(limits, costs.prompt_count(admitted.body))
        )
        self.flow.precheck(tenant, flow, prompt + output)

    def check_model(self, tenant: str, name: Any) -> None:
        """The 404 of an unknown model for one the tenant's ``models`` allow-list leaves
        out (adapters included): word for word the same, so it tells nothing of what
        exists, and no runtime adapter load follows."""
        tenancy = self.tenancy
        if not isinstance(name, str) or not name or tenancy.may_use(tenant, name):
            return  # auth off (every model open), or listed as sent
        if not tenancy.may_use(tenant, self.models.alias(name)):
            raise APIError(
                404,
                f"The model `{clip(name)}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def _tokenize_lazy(self, admitted: _Admitted, renderer: Renderer) -> Sequence[int] | Head:
        """``_tokenize``, or for a chat prompt with new text a head (router/routing/lazy_tail.py)."""
        if admitted.chat is None:
            return self._tokenize(admitted)
        with renderer.cache_scope(admitted.salt.salt):
            return renderer.chat_head(
                admitted.chat, admitted.entry.block_size, self._lazy_min_rest(renderer)
            )

    def _lazy_min_rest(self, renderer: Renderer) -> int:
        """Below this much text from the first new segment on, a head is not worth its
        overhead (a second pass, the hand-off, ~0.2 ms a request): with fastokens, the rest
        the loop would encode in place anyway; with Hugging Face's BPE (~2.5 ms per 1,000
        tokens), any rest."""
        return _loop_encode_chars(renderer) if renderer.fast_encoder else 0

    def _tail_inline(self, head: Head, renderer: Renderer) -> bool:
        """Whether a head's rest is small enough to tokenize on the loop once it is sent."""
        return head.rest_chars <= _loop_encode_chars(renderer)

    def _tokenize(self, admitted: _Admitted) -> Sequence[int]:
        renderer = admitted.entry.renderer
        if renderer is None:  # router/models/fallback.py: labelled text_prefix
            if admitted.chat is None:
                admitted.batch.append(fallback.batch_rest(admitted.body))
            return fallback.prompt_ids(admitted.chat, admitted.body)
        # The segment cache is scoped like the replicas' prefix caches: by the salt sent;
        # new text is encoded within a CPU budget, and stops once it cannot fit the context.
        budget = scope.budget(
            self.config.limits.max_tokenize_cpu_s, self._max_prompt_tokens(admitted)
        )
        with renderer.cache_scope(admitted.salt.salt), budget:
            if admitted.chat is not None:
                return renderer.chat_ids(admitted.chat)
            # Honours add_special_tokens and truncation; a batch routes on its first prompt
            # and is priced by all of them.
            prompts = renderer.completion_request_ids(admitted.body)
            admitted.batch.append(sum(len(ids) for ids in prompts[1:]))
            return prompts[0]

    def _max_prompt_tokens(self, admitted: _Admitted) -> int | None:
        """The model's context: a longer prompt is refused anyway. None when unknown, or
        when the request asks vLLM to truncate it."""
        if "truncate_prompt_tokens" in {**admitted.body, **(admitted.chat or {})}:
            return None
        return self.upkeep.context_of(admitted.model, admitted.entry)

    def _admit_and_tokenize(
        self, raw: bytes, endpoint: Endpoint, tenant: str
    ) -> tuple[_Admitted, Sequence[int]]:
        admitted = self._admit(raw, endpoint, tenant)
        return admitted, self._tokenize(admitted)

    def serving(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The replicas that can take a request for ``model`` (router/models/upkeep.py); a
        name no replica has listed yet is a 503 while their models are not known."""
        if not exclude:  # the first pick; a retry's name was checked then
            self.upkeep.check_known(model)
        return self.upkeep.serving(model, exclude)

    # -- flow control (router/flow/): a ticket before forwarding ----------------------------
    def _flow_replicas(self, model: str) -> list[Replica]:
        fleet = self.wiring.opened
        return fleet.serving(model) if fleet is not None else []

    @staticmethod
    def flow_model(rr: RoutedRequest) -> str:
        """The model flow control keys ``rr`` by: its base model, so a LoRA adapter's requests
        share the base's queue, slots, bounds and cost (an adapter name is not a way round
        them; the adapter runs on the base's replicas and takes their prefill)."""
        return rr.model_entry.name if rr.model_entry is not None else rr.model

    def flow_request(self, rr: RoutedRequest, headers: Mapping[str, str]) -> FlowRequest:
        """What flow control reads of a prepared request: its tenant's weight and band from
        the tenancy table, its session where the client names one."""
        return FlowRequest(
            model=self.flow_model(rr),
            tenant=rr.tenant,
            session=session_of(rr.endpoint, rr.body, headers, self.response_chains),
            settings=self.tenancy.policy_of(rr.tenant).flow,
            prompt_tokens=rr.num_tokens,
            max_tokens=rr.max_tokens,
            batch_tokens=rr.batch_tokens,
            sequences=rr.sequences,
            stream=rr.stream,
        )

    async def admit(self, rr: RoutedRequest, headers: Mapping[str, str]) -> Ticket:
        """Flow control's ticket for ``rr`` (at once unless the fleet is saturated), or a
        429 ``APIError``."""
        return await self.flow.admit(self.flow_request(rr, headers), lambda: self.uncached(rr))

    async def admit_forwarded(
        self, tenant: str, model: str | None, prompt_tokens: int, queued: bool
    ) -> Ticket:
        """Flow control's ticket for a forwarded request (router/api/forwarded.py): its
        tenant's rpm, and tpm on ``prompt_tokens`` (an estimate: nothing renders it here);
        with ``queued`` and a model, a prefill slot of that model as a generation request
        takes, waiting in its tenant's flow while the model's replicas are saturated."""
        req = FlowRequest(
            model=model or "",
            tenant=tenant,
            session="",
            settings=self.tenancy.policy_of(tenant).flow,
            prompt_tokens=prompt_tokens,
            max_tokens=0,  # pooling, scoring, tokenizing: no output tokens
            stream=False,
        )

        async def estimate() -> Estimate:
            return prompt_tokens, (), None

        return await self.flow.admit(req, estimate, queued=queued and model is not None)

    async def uncached(self, rr: RoutedRequest) -> Estimate:
        """Prompt tokens the best-placed replica would prefill, and the replicas holding that
        much: the scheduler's prefix match (the index lookup a decision makes), without a
        decision. Nobody holding it: also the policy's choice among given replicas
        (``place_unheld``), for flow control's slot."""
        replicas = self._flow_replicas(self.flow_model(rr))
        if not replicas or not self.policy.uses_index:
            return rr.num_tokens, (), None
        matches = await self.wiring.index.match(rr.block_hashes, [r.url for r in replicas])
        best = min(
            max(matches.values(), default=0), blocks.cacheable_blocks(rr.num_tokens, rr.block_size)
        )
        uncached = max(0, rr.num_tokens - best * rr.block_size)
        if not best:
            return uncached, (), functools.partial(self.place_unheld, rr)
        holders = tuple(url for url, m in matches.items() if min(m, best) == best)
        return uncached, holders, None

    def place_unheld(self, rr: RoutedRequest, urls: list[str]) -> str:
        """The policy's replica for ``rr`` among ``urls`` while nobody holds its prefix: its
        picker's rule for a cold prefix (ring_spill: shortest queue, fewest in flight, least
        recent traffic, ring order), read now. Flow control reserves the request's slot there
        and ``decide(..., slot=)`` sends it there: one rule for both."""
        wanted = set(urls)
        replicas = [r for r in self._flow_replicas(self.flow_model(rr)) if r.url in wanted]
        if not replicas:
            return urls[0]
        return self.policy.choose(rr, [r.candidate(0) for r in replicas]).replica

    async def plan(
        self,
        rr: RoutedRequest,
        exclude: frozenset[str] = frozenset(),
        slot: str | None = None,
        role: Role = "both",
    ) -> Plan:
        """Where ``rr``'s legs go (router/routing/plan.py): today one leg, ``role``'s pipeline's
        replica, with the prompt tokens it is predicted to compute. ``slot``: where flow
        control reserved the request's prefill slot (``Ticket.replica``); a prefix nobody
        holds goes there, a replica no request queued before it waits for
        (``Capacity.best_unheld``)."""
        t0 = time.perf_counter()
        policy = self.pipelines[role]
        replicas = self.upkeep.serving(rr.model, exclude, rr.model_entry, rr.lora)
        if rr.pinned_replica is not None:  # holds the state the request names
            replicas = [r for r in replicas if r.url == rr.pinned_replica] or replicas
        urls = [r.url for r in replicas]
        latest = lazy_tail.latest(rr)
        matches = (
            await self.wiring.index.match(latest.block_hashes, urls) if policy.uses_index else {}
        )
        tail = latest.tail
        if tail is not None and tail.full is None:
            on_head = tail.decides(matches)
            self.metrics.lazy_tail.labels("head" if on_head else "full").inc()
            if not on_head:  # a match reaches the head's end: wait for the rest (exact)
                latest = await self.complete(latest)
                if policy.uses_index:
                    matches = await self.wiring.index.match(latest.block_hashes, urls)
        if slot is not None and policy.uses_index and not any(matches.values()):
            replicas = [r for r in replicas if r.url == slot] or replicas
        decision = policy.choose(latest, [r.candidate(matches.get(r.url, 0)) for r in replicas])
        if latest.lora is not None:
            self.upkeep.plan_adapter(latest, decision.replica)  # loaded there first
        fleet = self.wiring.opened
        if fleet is not None:
            replica = fleet.replicas[decision.replica]
        else:  # offline: the candidates are all there is
            replica = next(r for r in replicas if r.url == decision.replica)
        # Counted on the request as it was handed in (a lazy head: its estimate, made exact
        # by the exchange once the tail is tokenized).
        prefill = max(0, rr.num_tokens - decision.matched_blocks * rr.block_size)
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        return Plan((Leg(role, replica, decision, prefill),))

    async def decide(
        self, rr: RoutedRequest, exclude: frozenset[str] = frozenset(), slot: str | None = None
    ) -> Decision:
        """The policy's replica for ``rr`` (its plan's one leg): what explain shows."""
        return (await self.plan(rr, exclude, slot)).legs[0].decision

    async def forget_unsent(self, rr: RoutedRequest, decision: Decision) -> None:
        """The replica failed before computing the blocks recorded for it: take back what
        was new to it."""
        rr = await self.complete(rr)  # a retry: rare, and the tail must not re-record
        if (tail := rr.tail) is not None:
            tail.taken_back.add(decision.replica)
        unsent = rr.block_hashes[decision.matched_blocks :]
        if self.wiring.fleet_mode is None:
            await self.wiring.index.forget(decision.replica, unsent)
        else:
            self.spawn(self.wiring.index.forget(decision.replica, unsent))

    async def record_placement(self, rr: RoutedRequest, decision: Decision) -> None:
        """The chosen replica will hold the prompt's blocks. Runs while the request is on
        its way (``UpstreamPool.post``), and before anything else runs on this loop. A lazy
        head's blocks are recorded now, the full prompt's once its tail is tokenized; a
        small tail is tokenized here, now that the replica has the request, and recorded
        once."""
        rr = lazy_tail.latest(rr)
        if (tail := rr.tail) is not None and tail.finish_inline is not None:
            rr = await self.complete(rr)
        if lazy_tail.pending(rr):
            self.spawn(self._record_tail(rr, decision))
        if self.wiring.fleet_mode is None:
            await self.wiring.index.record(decision.replica, rr.block_hashes)
        else:  # a Redis write stays off the request's critical path
            self.spawn(self.wiring.index.record(decision.replica, rr.block_hashes))
        self.metrics.placed(decision)

    async def _record_tail(self, rr: RoutedRequest, decision: Decision) -> None:
        full = await self.complete(rr)
        tail = rr.tail
        if tail is None or decision.replica not in tail.taken_back:
            await self.wiring.index.record(decision.replica, full.block_hashes)

    def count_prompt(self, rr: RoutedRequest) -> None:
        """The prompt-tokens metric, with the full count (a lazy head's once it is known)."""
        tail = rr.tail
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
            self.learner.learn(lazy_tail.latest(rr), decision, outcome)

    async def _learn_later(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        self.learner.learn(await self.complete(rr), decision, outcome)
