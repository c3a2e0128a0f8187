"""What each answered request teaches the gateway: the outcome counters, the replica's observed
wait, the model's counters and drift watch (router/models/upkeep.py), the observers
(diagnostics, the Responses store, precise mode), and -- where the replica reported no cached
tokens on prompts the index said it held -- a reset of what the index believed about it
(router/fleet/cache_loss.py). The request path (router/routing/request_path.py) calls it once a request's
prompt is complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from router.config import Config
from router.fleet import cache_loss
from router.fleet.cache_loss import LostCache
from router.fleet.wiring import FleetWiring
from router.intake.parse import skips_cache_read
from router.intake.routed_request import RoutedRequest
from router.models.upkeep import ModelUpkeep, Spawn
from router.routing import generated, reuse
from router.schedule import Decision
from router.schedule.observed import is_wait_sample
from router.telemetry.metrics import Metrics
from router.upstream.proxy import Outcome

log = logging.getLogger("prefix_router")


class Observer(Protocol):
    """Watches every finished request (live diagnostics, the Responses store, precise
    mode's placements)."""

    def observe(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None: ...


class Learner:
    """Learns from every answered request of one gateway."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        wiring: FleetWiring,
        upkeep: ModelUpkeep,
        observers: list[Observer],
        spawn: Spawn,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.wiring = wiring
        self.upkeep = upkeep
        self.observers = observers  # the gateway's list: watchers added later see requests
        self.spawn = spawn
        self._lost: dict[str, LostCache] = {}  # replica -> evidence its cache was lost

    def _record_generated(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        """The replica cached the answer's full blocks too (router/routing/generated.py)."""
        if not outcome.answer:
            return
        if self.wiring.kv_events is not None:
            # Precise mode: the replicas' events report them (vLLM's BlockStored covers
            # generated blocks), and a record there is a placement whose events are awaited.
            outcome.answer = b""
            return
        answer, outcome.answer = outcome.answer, b""  # not held past this
        args = (rr, outcome.status, answer, outcome.completion_tokens)
        if len(answer) <= generated.INLINE_BYTES:
            self._record_extra(decision.replica, rr, generated.hashes_after(*args))
        else:  # a long answer: parsed and re-tokenized off the loop, recorded a moment later
            self.spawn(self._record_generated_later(decision.replica, args))

    async def _record_generated_later(self, replica: str, args: Any) -> None:
        loop = asyncio.get_running_loop()
        extra = await loop.run_in_executor(self.upkeep.executor, generated.hashes_after, *args)
        self._record_extra(replica, args[0], extra)

    def _record_extra(self, replica: str, rr: RoutedRequest, extra: list[int]) -> None:
        if extra:
            self.spawn(self.wiring.index.record(replica, [*rr.block_hashes, *extra]))

    def learn(
        self, rr: RoutedRequest, decision: Decision, outcome: Outcome, relayed: bool = True
    ) -> None:
        """Count the outcome, feed the replica's observed wait, the model's counters and
        drift watch and the observers, and correct the index where the replica reported
        fewer cached tokens than predicted."""
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
        fleet = self.wiring.opened
        replica = fleet.replicas.get(decision.replica) if fleet else None
        if replica is not None and is_wait_sample(rr.stream, outcome.status, uncached):
            replica.ttft.observe(outcome.first_byte_s)
        predicted = decision.matched_blocks * rr.block_size
        self.metrics.child(self.metrics.predicted_cached_tokens, rr.tenant).inc(predicted)
        skips = skips_cache_read(rr.body, rr.endpoint)  # its report says nothing of the cache
        if relayed:  # a disaggregated request's answer is its decode leg's
            reuse.account(self.metrics, rr, decision, outcome, skips)
        if rr.model_entry is not None:
            self.upkeep.learn(rr.model_entry, predicted, outcome.cached_tokens)
        for observer in self.observers:
            observer.observe(rr, decision, outcome)
        self._record_generated(rr, decision, outcome)
        if outcome.cached_tokens is None:
            return
        reported = outcome.cached_tokens
        self.metrics.child(self.metrics.reported_cached_tokens, rr.tenant).inc(reported)
        if skips:
            return  # served without reading the cache: its report says nothing about it
        self.metrics.prediction_error.observe(predicted - reported)
        kv_events = self.wiring.kv_events
        if kv_events is not None and kv_events.is_up(decision.replica):
            return  # the replica's events keep the index exact
        if reported == 0 and decision.matched_blocks >= 2 and rr.block_hashes:
            evidence = self._lost.setdefault(decision.replica, LostCache(self.config.auth.enabled))
            if evidence.miss(time.monotonic(), rr.tenant, rr.block_hashes[-1]):
                # Misses of different prompts, from different tenants or over time: the
                # replica's cache was lost (restart, reset) behind our back. Forget what we
                # believed about it but this request.
                log.info(
                    "replica %s reported no cached tokens on %d prompts where the index "
                    "predicted hits; resetting its index",
                    decision.replica,
                    cache_loss.REPORTS,
                )
                self.spawn(self.wiring.reset_replica(decision.replica, rr.block_hashes))
