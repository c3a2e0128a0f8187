"""What passes from a prefill leg to its decode leg, for one request's exchange
(router/routing/exchange.py): the prefill leg's body, its answer read (and checked: a fleet
misconfigured for P/D is never silent), the decode leg's body, and what each leg teaches.

A decode leg is only ever sent with the parameters of the prefill leg run for it in the
same plan: a decode replica failing before its first byte makes the exchange plan again,
prefill leg included, since the same parameters sent to a second decode replica may read
blocks the prefill replica has freed (silent corruption on real NIXL)."""

from __future__ import annotations

import dataclasses
import json

from router.disagg import legs
from router.disagg.watch import LOOPBACK_SIDE_CHANNEL, NO_TRANSFER_PARAMS, PdWatch
from router.fleet.replicas import Replica
from router.intake.routed_request import RoutedRequest
from router.routing.plan import Leg, Plan
from router.upstream.proxy import Outcome

# A decode leg's answers retried rather than relayed: vLLM answers a failed KV pull with a
# 500 (E/generate/base/serving.py), before any byte of the answer.
PULL_RETRY = frozenset({500, 502, 503})


class Handover:
    """One plan's hand-over from its prefill leg to its decode leg."""

    __slots__ = ("answer", "prefill", "pulls_from", "rr", "split", "watch")

    def __init__(self, rr: RoutedRequest, plan: Plan, watch: PdWatch) -> None:
        self.rr = rr
        self.watch = watch
        self.split = len(plan.legs) > 1
        self.answer: legs.PrefillAnswer | None = None  # the prefill answer, once in
        self.pulls_from: str | None = None  # the prefill replica a decode leg pulls from
        self.prefill: Replica | None = None  # that replica
        if plan.skipped is not None:
            watch.skipped.labels(plan.skipped).inc()

    def outgoing(self, leg: Leg) -> tuple[Leg, bytes]:
        """``leg`` as it is sent, and its bytes: a one-leg plan's leg and the client's
        request; a split plan's legs counted, the decode leg with its prefill count restored
        if its prefill leg gave it nothing to pull (``_decode_leg``)."""
        if not self.split:
            return leg, self.rr.forwarded_body()
        leg = self._decode_leg(leg)
        self.watch.legs.labels(leg.role).inc()
        return leg, self._body(leg)

    def _body(self, leg: Leg) -> bytes:
        """The bytes a split plan's ``leg`` sends."""
        rr = self.rr
        if leg.role == "prefill":
            return json.dumps(legs.prefill_body(rr.endpoint, rr.body)).encode()
        answer = self.answer
        if leg.role == "decode" and answer is not None and answer.params is not None:
            return json.dumps(legs.decode_body(rr.body, answer)).encode()
        return rr.forwarded_body()  # the client's request, served whole

    def _decode_leg(self, leg: Leg) -> Leg:
        """The decode leg as sent: without transfer parameters from its prefill leg it
        computes the prompt itself (its prefill count restored)."""
        if leg.role != "decode":
            return leg
        if self.answer is not None and self.answer.params is not None:
            rr = self.rr
            decision = leg.decision
            pulled = legs.pulled_blocks(rr.num_tokens, rr.block_size, decision.matched_blocks)
            most = max((s.matched_blocks for s in decision.scores), default=0)
            fewest = legs.pulled_blocks(
                rr.num_tokens, rr.block_size, max(most, decision.matched_blocks)
            )
            self.watch.pulled_blocks.inc(pulled)
            self.watch.fewest_pulled.inc(fewest)
            return leg
        held = leg.decision.matched_blocks * self.rr.block_size
        return dataclasses.replace(leg, prefill_tokens=max(0, self.rr.num_tokens - held))

    def prefill_answered(self, leg: Leg, data: bytes, outcome: Outcome) -> None:
        """Read the prefill answer. A 4xx (the client's request refused) or an answer without
        parameters sends the client's own request to the decode replica, which answers it
        whole; the latter is a misconfigured fleet and said so."""
        answer = legs.prefill_answer(self.rr.endpoint, data) if outcome.status == 200 else None
        self.answer = answer
        url = leg.replica.url
        if answer is None:
            self.watch.fallbacks.labels(f"prefill_http_{outcome.status // 100}xx").inc()
            return
        if answer.params is not None:
            self.pulls_from, self.prefill = url, leg.replica
        if answer.params is None:
            self.watch.problem(NO_TRANSFER_PARAMS, url)
            self.watch.fallbacks.labels(NO_TRANSFER_PARAMS).inc()
        elif legs.loopback_side_channel(answer.params, url):
            self.watch.problem(LOOPBACK_SIDE_CHANNEL, url, answer.params.get("remote_host"))

    def failed(self, leg: Leg, why: str) -> Replica:
        """``leg`` failed before its first byte, and the exchange plans again without the
        replica returned: the leg's own, or for a decode leg that answered a 500 after
        pulling, the prefill replica (vLLM's kv_load_failure_policy "fail": the pull failed,
        most likely the prefill replica went away with the blocks)."""
        if leg.role == "decode" and self.prefill is not None and why == "HTTP 500":
            self.watch.fallbacks.labels("pull_failed").inc()
            return self.prefill
        if self.split:
            self.watch.fallbacks.labels(f"{leg.role}_failed").inc()
        return leg.replica

    def learned(self, leg: Leg, outcome: Outcome) -> Outcome:
        """The outcome ``leg`` teaches: a decode leg that pulled reports the prefill side's
        cached tokens (vLLM 0.34's output processor), not its own, so it teaches nothing
        about its own cache (KV events and the index record of its pulled blocks do)."""
        if leg.role == "decode" and self.answer is not None and self.answer.params is not None:
            return dataclasses.replace(outcome, cached_tokens=None)
        return outcome
