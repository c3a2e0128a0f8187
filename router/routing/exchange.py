"""The exchange: one routed request's whole life after ``prepare``, in named phases.

    admit        flow control's ticket (waits while the fleet is full); the prompt counted
                 (a lazy head's by ``tail_known``, the one hook on its tail)
    plan         the scheduler's legs (router/routing/plan.py): one ``both`` leg today
    each leg:    account   in flight, pending prefill (router/routing/accounting.py)
                 send      through the transport (router/upstream/transport.py), which reports
                           ``sent`` (placement recorded in the index) and ``first_byte``
                 outcome   answered; or unavailable before the first byte: its blocks taken
                           back, and the request re-planned on another replica within the
                           retry rules (router/routing/forwarder.py ``Retries``); or the client gone
    learn        the answer compared with the prediction (after the response is written)
    close        the ticket released, on every path out

Chat, completions, Messages and Responses all go this way. The exchange calls the
transport, never the other way round but for the two reports, so a transport where another
proxy sends the bytes (an Envoy ext_proc stream) feeds the same phases without touching the
scheduler, the index, flow control or learning. ``Exchanges`` holds the collaborators, built
once per gateway; an ``Exchange`` holds the mutable state of one request's life.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from router.disagg.collect import Collect
from router.disagg.handover import PULL_RETRY, Handover
from router.disagg.watch import PdWatch
from router.fleet.replicas import Fleet
from router.flow.ticket import Ticket
from router.intake.routed_request import Endpoint, RoutedRequest
from router.routing import generated, lazy_tail
from router.routing.accounting import Attempt, charge, prefilled, release
from router.routing.forwarder import Retries, idle_among, queued_everywhere
from router.routing.plan import Leg
from router.routing.request_path import RequestPath
from router.upstream.proxy import (
    RETRYABLE_STATUS,
    STREAM_ERROR_SHAPES,
    Outcome,
    UpstreamUnavailable,
)
from router.upstream.transport import Transport, Wire

log = logging.getLogger("prefix_router")

A = TypeVar("A")
T = TypeVar("T")

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


def why_label(why: str) -> str:
    """A failure's kind for a metric label: ``bad response: <parser text>`` -> ``bad response``,
    so label values stay a small, fixed set."""
    return why.split(":", 1)[0][:40]


def replica_name(fleet: Fleet, url: str, auth: bool) -> str:
    """A replica as a client may see it: its URL with auth off, else ``replica-<n>`` (its
    place in the replica list), so tenants learn no internal addresses."""
    if not auth:
        return url
    for n, known in enumerate(fleet.replicas):
        if known == url:
            return f"replica-{n}"
    return "replica"


class Exchanges:
    """What every exchange of one gateway works with, built once and passed in."""

    def __init__(
        self,
        path: RequestPath,
        retries: Retries,
        fleet: Callable[[], Fleet],
        decision_headers: bool,
        auth: bool,
        collect: Collect,
        pd: PdWatch,
    ) -> None:
        self.path = path
        self.collect = collect  # a prefill leg's transport: its answer read, not relayed
        self.pd = pd  # prefill/decode disaggregation's metrics and warnings
        self.retries = retries
        self.metrics = path.metrics
        self.fleet = fleet  # the fleet exists once the gateway has started
        # Which replica answered is for operators: off by default when tenants are
        # separated, and never its URL for a tenant (replica_name).
        self.decision_headers = decision_headers
        self.auth = auth


class Exchange(Generic[A]):
    """One routed request, from admission to its ticket's release (``run``), its answer as
    ``transport`` gives it (the relay: the client's response). It is the transport's
    ``Report`` for the leg being sent, and holds what changes in the request's life: the
    ticket, the replicas tried, the leg being sent (its ``Attempt``)."""

    __slots__ = (
        "owner",
        "path",
        "rr",
        "client_headers",
        "upstream_headers",
        "transport",
        "ticket",
        "tried",
        "only",
        "attempt",
        "_sent_at",
    )

    def __init__(
        self,
        owner: Exchanges,
        rr: RoutedRequest,
        client_headers: Mapping[str, str],
        upstream_headers: Mapping[str, str],
        transport: Transport[A],
        only: frozenset[str] | None = None,
    ) -> None:
        self.owner = owner
        self.path = owner.path
        self.rr = rr
        self.client_headers = client_headers  # what flow control reads (a session header)
        self.upstream_headers = upstream_headers  # the client's, as a replica may see them
        self.transport = transport
        self.ticket: Ticket | None = None
        self.tried: set[str] = set()  # replicas that failed before their first byte
        # The replicas the request may go to (None: any): an endpoint picker's subset hint,
        # or the one a proxy already sent it to (``UpstreamUnavailable.went``).
        self.only = only
        self.attempt: Attempt | None = None  # the leg being sent
        self._sent_at = 0.0

    async def run(self) -> A:
        """admit -> plan -> each leg -> learn (``answered``) -> close."""
        owner, rr, path = self.owner, self.rr, self.path
        owner.metrics.child(owner.metrics.tenant_requests, rr.tenant).inc()
        ticket = self.ticket = await path.admit(rr, self.client_headers)  # waits while full
        retries = owner.retries
        retries.begin()
        retrying = False  # holds one of the budget's retries until the request ends
        try:
            # admit's other half: the prompt counted (a lazy head's once its tail is known).
            tail = rr.tail
            if tail is not None and tail.full is None:
                tail.on_full = self.tail_known
            else:
                prompt = lazy_tail.latest(rr).num_tokens
                owner.metrics.child(owner.metrics.prompt_tokens, rr.tenant).inc(prompt)
            fleet = owner.fleet()
            while True:
                # plan: the scheduler's legs, avoiding the replicas that failed; flow
                # control's slot counted where the prompt is prefilled (the first leg).
                plan = await path.plan(rr, self.excluded(fleet), ticket.replica)
                first = plan.legs[0]
                ticket.decided(
                    first.replica.url,
                    first.prefill_tokens + rr.batch_tokens,  # a batch's others are prefilled too
                    path.flow.expected_output(rr.max_tokens, rr.sequences),
                )
                handover = Handover(rr, plan, owner.pd)
                for leg in plan.legs:  # adapters first: a decode leg never waits after P
                    await path.upkeep.ensure_adapter(rr, leg.replica)
                for leg in plan.legs:
                    if plan.decode_after_prefill and handover.pulls_from and leg.role == "decode":
                        leg = await self.decode_again(leg)
                    leg, body = handover.outgoing(leg)
                    try:
                        if leg.role == "prefill":
                            data, outcome = await self.leg(leg, owner.collect, body)
                            handover.prefill_answered(leg, data, outcome)
                        else:
                            pulls_from = handover.pulls_from
                            answer, outcome = await self.leg(leg, self.transport, body, pulls_from)
                    except UpstreamUnavailable as e:
                        failed = handover.failed(leg, e.why)  # a failed pull: the prefill's
                        self.tried.add(failed.url)
                        await self.unavailable(leg, e.why)
                        tried = frozenset(self.tried)
                        retrying = await retries.failed(
                            fleet, failed, e, tried, retrying, self.saturated, self.idle
                        )
                        if e.went is not None:  # the bytes went there: booked there
                            self.only = frozenset({e.went})
                        log.info(
                            "request %s: %s failed before the first byte (%s); retrying",
                            rr.request_id,
                            failed.url,
                            e.why,
                        )
                        break  # re-planned: a failed decode leg runs its prefill again
                    await self.answered(leg, handover.learned(leg, outcome))
                else:
                    return answer
        finally:
            retries.end(retrying)
            ticket.done()  # close: its prefill slot back, however the request ended

    async def decode_again(self, planned: Leg) -> Leg:
        """Prefill-first order: the decode replica chosen now, on the load once the prefill
        leg answered (an adapter loaded if it moved: the one wait between the legs)."""
        path, rr = self.path, self.rr
        leg = await path.leg(rr, self.excluded(self.owner.fleet()), None, "decode")
        if leg.replica is not planned.replica:
            await path.upkeep.ensure_adapter(rr, leg.replica)
        return dataclasses.replace(leg, prefill_tokens=0)

    def excluded(self, fleet: Fleet) -> frozenset[str]:
        """The replicas the plan must avoid: those that failed, and any outside ``only``."""
        if self.only is None:
            return frozenset(self.tried)
        return frozenset(self.tried).union(u for u in fleet.replicas if u not in self.only)

    # -- one leg: account, send, first byte, outcome -----------------------------------------
    async def leg(
        self, leg: Leg, transport: Transport[T], body: bytes, pulls_from: str | None = None
    ) -> tuple[T, Outcome]:
        """Send ``leg`` as ``body`` over ``transport`` (a prefill leg's answer is collected,
        not relayed: router/disagg/collect.py; ``pulls_from``: a decode leg's prefill
        replica)."""
        rr, ticket, owner = self.rr, self.ticket, self.owner
        metrics = owner.metrics
        assert ticket is not None
        attempt = Attempt(leg.replica, leg.decision, leg.prefill_tokens)
        # The leg as it goes out: the answer carries the request id, flow control's
        # rate-limit headers and, for operators, the decision.
        extra = {"x-request-id": rr.request_id, **ticket.headers}
        if owner.decision_headers:
            url = leg.replica.url
            extra["x-prefix-router-replica"] = replica_name(owner.fleet(), url, owner.auth)
            extra["x-prefix-router-cached-blocks"] = str(leg.decision.matched_blocks)
            if ticket.why:
                extra["x-prefix-router-queued-ms"] = f"{ticket.queued_s * 1000:.0f}"
            if pulls_from is not None:
                name = replica_name(owner.fleet(), pulls_from, owner.auth)
                extra["x-prefix-router-prefill-replica"] = name
        tokens = rr.max_tokens
        if tokens is not None:
            tokens *= rr.sequences  # completion_tokens counts every choice of every prompt
        wire = Wire(
            leg.replica.url + PATHS[rr.endpoint],
            body,
            self.upstream_headers,
            extra,
            "POST",
            STREAM_ERROR_SHAPES[rr.endpoint],
            owner.fleet().first_byte_timeout(leg.replica, rr.stream, tokens),
            PULL_RETRY if pulls_from is not None else RETRYABLE_STATUS,
            generated.wanted(rr),
        )
        self.attempt = attempt
        outcome: Outcome | None = None
        client_gone = False
        charge(metrics, attempt)  # nothing between it and the ``try`` may raise
        try:
            self.path.policy.placed(leg.decision)
            self._sent_at = time.perf_counter()
            # When its prefill slot frees: after every prompt of a batch.
            ticket.sent(leg.prefill_tokens + rr.batch_tokens, rr.stream)
            answer, outcome = await transport.send(wire, self)
            self.first_byte()  # a transport that did not report it: it came with the answer
            return answer, outcome
        except asyncio.CancelledError:
            client_gone = True
            raise
        finally:
            release(metrics, attempt)
            self.attempt = None
            # Every leg ends here once, whichever way it ended (its load released).
            if client_gone:
                metrics.client_disconnects.inc()
                metrics.requests.labels(leg.replica.url, leg.decision.policy, "client_gone").inc()
            self.path.policy.done(leg.decision, outcome.status if outcome else None)

    def tail_known(self, full: RoutedRequest) -> None:
        """A lazy head's tail is tokenized (router/routing/lazy_tail.py): the prompt counted,
        and the leg being sent, which counted the tail's estimate, given the exact count."""
        owner = self.owner
        owner.metrics.child(owner.metrics.prompt_tokens, full.tenant).inc(full.num_tokens)
        attempt = self.attempt
        if attempt is not None and attempt.decision is not None:
            matched = attempt.decision.matched_blocks
            attempt.set_prefill_tokens(max(0, full.num_tokens - matched * full.block_size))

    # -- the transport's reports (``Report``) ------------------------------------------------
    async def sent(self) -> None:
        """On its way: the replica will hold the prompt's blocks (the index records them)."""
        attempt = self.attempt
        if attempt is not None and attempt.decision is not None:
            await self.path.record_placement(self.rr, attempt.decision)

    def first_byte(self) -> None:
        """The replica's first bytes: its prefill is done (once per leg)."""
        attempt = self.attempt
        if attempt is None or not prefilled(attempt):
            return
        ticket = self.ticket
        assert ticket is not None and attempt.decision is not None
        if self.rr.stream:
            ticket.observed(attempt.prefill_tokens, time.perf_counter() - self._sent_at)
        ticket.first_byte()  # flow control: the replica's prefill slot is free
        self.path.policy.first_byte(attempt.decision)

    # -- outcome -----------------------------------------------------------------------------
    async def unavailable(self, leg: Leg, why: str) -> None:
        """The replica failed before the first byte: what was recorded for it taken back."""
        decision = leg.decision
        await self.path.forget_unsent(self.rr, decision)
        metrics = self.owner.metrics
        metrics.retries.labels(decision.replica, why_label(why)).inc()
        metrics.requests.labels(decision.replica, decision.policy, "unavailable").inc()

    def saturated(self, tried: frozenset[str]) -> bool:
        """Flow control holds requests of its (base) model or has no free prefill slot, or
        every other replica serving it has a queue of its own: a timed-out request is shed,
        not sent again."""
        model = self.path.flow_model(self.rr)
        if self.path.flow.saturated(model):
            return True
        return queued_everywhere(r for r in self.owner.fleet().serving(model) if r.url not in tried)

    def idle(self, tried: frozenset[str]) -> bool:
        """Another replica serving its model has nothing waiting: a retry there is failover,
        not added load (it needs none of the retry budget)."""
        model = self.path.flow_model(self.rr)
        return idle_among(r for r in self.owner.fleet().serving(model) if r.url not in tried)

    async def answered(self, leg: Leg, outcome: Outcome) -> None:
        """The replica's answer was relayed (a prefill leg's: kept): its health, a Responses
        chain, then learning."""
        relayed = leg.role != "prefill"
        rr, ticket = self.rr, self.ticket
        assert ticket is not None
        await self.owner.fleet().record_response(
            leg.replica,
            outcome.status,
            stream=rr.stream and relayed,  # a prefill leg is answered whole
            first_byte_s=outcome.first_byte_s,
            completion_tokens=outcome.completion_tokens,
        )
        if relayed and rr.endpoint == "responses" and ticket.session:
            self.path.response_chains.learn(outcome.head, ticket.session)
        # learn: after the response is written (the next loop turn, before any new request).
        asyncio.get_running_loop().call_soon(self.path.learn, rr, leg.decision, outcome, relayed)
