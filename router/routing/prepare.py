"""Prepare: a request body -> the ``RoutedRequest`` every later stage reads, with no replica
needed (``prefix-router explain`` runs it offline):

    parse -> model and tenant checks -> salt policy -> prompt (tokenize, or a lazy head) -> blocks

``RequestPath`` (router/routing/request_path.py) is a ``Preparation``: the one object the
handlers and the explain endpoint call; this module is its first job, the decision and what
follows are the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.config import Config
from router.core import blocks
from router.core.errors import APIError, bad_request, clip
from router.core.record import record
from router.fleet.wiring import FleetWiring
from router.flow.controller import FlowController
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
from router.telemetry.metrics import Metrics
from router.tenancy.tenants import SaltDecision, Tenancy

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


class Preparation:
    """``prepare`` and what it runs: parsing, admission checks, tokenizing, hashing. The
    collaborators are ``RequestPath``'s (set in its ``__init__``)."""

    config: Config
    metrics: Metrics
    wiring: FleetWiring
    executor: ThreadPoolExecutor
    tenancy: Tenancy
    flow: FlowController
    band_priority: bool
    limits: BodyLimits
    renderer: Renderer | None
    block_size: int
    models: ModelRegistry
    upkeep: ModelUpkeep
    converters: dict[Endpoint, ChatConverter]
    chain_cache: blocks.ChainCache
    lazy_tail: bool

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
            if tail.on_full is not None:
                tail.on_full(tail.full)
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
