"""The request path of one gateway, up to and after forwarding:

    prepare (parse -> tenancy -> prompt -> blocks) -> plan (schedule) -> [exchange] -> learn

``prepare`` and ``plan`` (``decide``: its one leg's decision) need no HTTP request: the live
handlers (router/http/handlers.py) and the explain endpoint both call them, so nothing is
re-implemented for explaining. ``prepare`` and what it runs are in router/routing/prepare.py
(``Preparation``); this module is the rest: flow admission, the plan, recording, learning.
What the path needs of a request's model (its renderer, block size and replicas) comes from
``served`` and ``serving``; the fleet, index and ring from ``FleetWiring``
(router/fleet/wiring.py). A routed request's life after ``prepare`` is its exchange
(router/routing/exchange.py), the HTTP surface router/http/handlers.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.config import Config
from router.core import blocks
from router.core.errors import APIError
from router.disagg import planner, roles
from router.disagg.decision import Thresholds
from router.fleet.replicas import Replica, Role
from router.fleet.wiring import FleetWiring
from router.flow.controller import FlowController, Ticket
from router.flow.request import Estimate, FlowRequest
from router.flow.sessions import ResponseChains, session_of
from router.flow.settings import FlowConfig
from router.intake.routed_request import Endpoint, RoutedRequest
from router.intake.shapes import BodyLimits
from router.kv_events.precise_index import PreciseIndex
from router.models import ModelRegistry
from router.models.upkeep import ModelUpkeep
from router.prompt import Renderer
from router.routing import lazy_tail
from router.routing.learning import Learner, Observer
from router.routing.plan import Leg, Plan
from router.routing.prepare import DEFAULT_BLOCK_SIZE, ChatConverter, Preparation
from router.schedule import Decision, Pipeline, from_config
from router.telemetry.metrics import Metrics
from router.tenancy.tenants import Tenancy
from router.upstream.proxy import Outcome

log = logging.getLogger("prefix_router")

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


class RequestPath(Preparation):
    """Prepare (router/routing/prepare.py), decide, record and learn, for every request of one
    gateway."""

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
        # Prefill/decode disaggregation (router/disagg/): a pipeline per pool.
        pd = config.disaggregation
        self.disaggregated = roles.disaggregating(config)
        self.thresholds = Thresholds(pd.pd_min_prompt_tokens, pd.pd_min_uncached_tokens)
        self.prefill_first = pd.pd_order == "prefill-first"
        for role, name in (("prefill", pd.pd_prefill_policy), ("decode", pd.pd_decode_policy)):
            routing = dataclasses.replace(config.routing, policy=name or config.routing.policy)
            self.pipelines[role] = from_config(routing, wiring.ring)  # type: ignore[index]
        # Route on a prompt's head and tokenize the rest off the critical path
        # (router/routing/lazy_tail.py), where the policy provably decides the same (not while
        # disaggregating: whether to split reads the whole prompt's length).
        why_not = lazy_tail.policy_allows(self.policy)
        self.lazy_tail = config.routing.lazy_tail and why_not is None and not self.disaggregated
        if config.routing.lazy_tail and why_not is not None:
            log.info("lazy tail off: %s", why_not)
        self.observers: list[Observer] = []
        # What each answered request teaches (router/routing/learning.py).
        self.learner = Learner(config, metrics, wiring, self.upkeep, self.observers, spawn)
        # Flow control (router/flow/): fair queuing per tenant while the replicas are full.
        self.flow = FlowController(
            FlowConfig.from_config(config.flow, tenants=config.auth.tenanted),
            self._flow_replicas,
            metrics.registry,
        )
        self.response_chains = ResponseChains()  # Responses chains as one session each

    def serving(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The replicas that can take a request for ``model`` (router/models/upkeep.py); a
        name no replica has listed yet is a 503 while their models are not known."""
        if not exclude:  # the first pick; a retry's name was checked then
            self.upkeep.check_known(model)
        return self.upkeep.serving(model, exclude)

    # -- flow control (router/flow/): a ticket before forwarding ----------------------------
    def _flow_replicas(self, model: str) -> list[Replica]:
        """The replicas whose prefill slots flow control counts: the prefill pool's in a
        disaggregated fleet (a request is admitted before its prefill leg; its decode leg is
        never queued in the gateway)."""
        fleet = self.wiring.opened
        if fleet is None:
            return []
        if self.disaggregated:
            return [r for r in fleet.serving(model) if roles.in_pool(r, "prefill")]
        return fleet.serving(model)

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
        """Where ``rr``'s legs go (router/routing/plan.py): one ``both`` leg, ``role``'s
        pipeline's replica with the prompt tokens it is predicted to compute, or in a
        disaggregated fleet a prefill and a decode leg (router/disagg/planner.py, which
        asks for each role's leg: ``leg``). ``slot``: where flow control reserved the
        request's prefill slot (``Ticket.replica``); a prefix nobody holds goes there, a
        replica no request queued before it waits for (``Capacity.best_unheld``)."""
        t0 = time.perf_counter()
        if self.disaggregated:
            if role == "both":
                return await planner.plan(
                    self.leg, rr, exclude, slot, self.thresholds, self.prefill_first
                )
            replicas = [
                r
                for r in self.upkeep.serving(rr.model, exclude, rr.model_entry, rr.lora)
                if roles.in_pool(r, role)
            ]
            if not replicas:
                raise APIError(503, f"no {role} replica is available", code="no_replica")
        else:
            replicas = self.upkeep.serving(rr.model, exclude, rr.model_entry, rr.lora)
        policy = self.pipelines[role]
        if rr.pinned_replica is not None:  # holds the state the request names
            replicas = [r for r in replicas if r.url == rr.pinned_replica] or replicas
        urls = [r.url for r in replicas]
        latest = lazy_tail.latest(rr)
        # A decode replica's holdings decide what it pulls, whatever its policy reads.
        indexed = policy.uses_index or role == "decode"
        matches, tiers = await self._match(latest, urls) if indexed else ({}, {})
        tail = latest.tail
        if tail is not None and tail.full is None:
            on_head = tail.decides(matches)
            self.metrics.lazy_tail.labels("head" if on_head else "full").inc()
            if not on_head:  # a match reaches the head's end: wait for the rest (exact)
                latest = await self.complete(latest)
                if policy.uses_index:
                    matches, tiers = await self._match(latest, urls)
        if slot is not None and policy.uses_index and not any(matches.values()):
            replicas = [r for r in replicas if r.url == slot] or replicas
        if tiers:  # precise mode with an offload tier: what each candidate would load
            weight = self.config.kv_events.kv_events_offload_weight
            candidates = [
                r.candidate(matches.get(r.url, 0), tiers.get(r.url, 0), weight) for r in replicas
            ]
        else:
            candidates = [r.candidate(matches.get(r.url, 0)) for r in replicas]
        decision = policy.choose(latest, candidates)
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

    async def _match(
        self, rr: RoutedRequest, urls: list[str]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Each replica's reusable blocks of ``rr`` (the index's GPU match, then what an
        offload tier holds right after it, as vLLM would load it and report it in
        ``cached_tokens``), and of those, the offloaded ones (precise mode only)."""
        matches = await self.wiring.index.match(rr.block_hashes, urls)
        index = self.wiring.index
        if not isinstance(index, PreciseIndex):
            return matches, {}
        tiers = index.offloaded(rr.block_hashes, matches)
        for url, n in tiers.items():
            matches[url] += n
        return matches, tiers

    async def leg(
        self,
        rr: RoutedRequest,
        exclude: frozenset[str] = frozenset(),
        slot: str | None = None,
        role: Role = "both",
    ) -> Leg:
        """``role``'s leg for ``rr`` (a disaggregated plan's prefill or decode leg)."""
        return (await self.plan(rr, exclude, slot, role)).legs[0]

    async def decide(
        self, rr: RoutedRequest, exclude: frozenset[str] = frozenset(), slot: str | None = None
    ) -> Decision:
        """The policy's replica for ``rr`` (its plan's one leg): what explain shows."""
        return (await self.plan(rr, exclude, slot)).last.decision

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

    def learn(
        self, rr: RoutedRequest, decision: Decision, outcome: Outcome, relayed: bool = True
    ) -> None:
        """Compare the prediction with what the replica reports, and correct the index (a
        lazy head's once its tail is tokenized: observers see the whole prompt).
        ``relayed``: the leg whose answer the client got (not a prefill leg)."""
        if lazy_tail.pending(rr):
            self.spawn(self._learn_later(rr, decision, outcome, relayed))
        else:
            self.learner.learn(lazy_tail.latest(rr), decision, outcome, relayed)

    async def _learn_later(
        self, rr: RoutedRequest, decision: Decision, outcome: Outcome, relayed: bool
    ) -> None:
        self.learner.learn(await self.complete(rr), decision, outcome, relayed)
