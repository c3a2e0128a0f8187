"""Flow control: while a model's replicas are saturated, requests wait in the gateway, one
flow per tenant (and per session inside it), and leave in weighted fair order, only as fast as
the replicas can start them.

    admit(request) -> Ticket            (passes at once while the fleet has room)
      saturated: queued in FairQueue    (band, tenant weight, session; cost = uncached
                                         prefill tokens + expected decode)
      released by pump()                (a prefill slot frees: a first byte, a failure)
      or shed with a 429                (per-tenant bound, overflow lowest band first,
                                         queue-time deadline, rate limits)
    ticket.first_byte() / ticket.done() (the slot is free again)

The ticket (``ticket.py``) gives its slot back; the metrics are in ``metrics.py``; the
order among tenants is ``fairqueue.py``'s and each replica's room ``saturation.py``'s.
Nothing here decides where a request goes: a released request is routed by the scheduler
as any other, so prefix affinity is kept. A client that leaves while queued is taken out of
the queue at once (its waiting task is cancelled), and every counter is given back in a
``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from router.core.errors import APIError
from router.core.tasks import cancel_and_wait
from router.flow.fairqueue import BAND_RANK, BANDS, Entry, FairQueue
from router.flow.metrics import FlowMetrics
from router.flow.ratelimit import RateLimiter
from router.flow.request import Estimate, FlowRequest, Place
from router.flow.reservations import Contention, Reservations
from router.flow.saturation import Capacity, ReplicaView, Waiting, capacity
from router.flow.settings import FlowConfig, FlowSettings
from router.flow.ticket import Ticket, shed_error, too_large

log = logging.getLogger("prefix_router.flow")


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    ticket: Ticket
    holders: tuple[str, ...] = ()  # replicas holding its longest cached prefix
    place: Place | None = None  # nobody holds it: where the scheduler would send it


class FlowController:
    """One gateway's flow control, for every model it serves."""

    def __init__(
        self,
        config: FlowConfig,
        replicas: Callable[[str], Sequence[ReplicaView]],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.clock = clock
        self.metrics = FlowMetrics(registry)
        self.limits = RateLimiter()
        self.queues: dict[str, FairQueue[_Waiter]] = {}
        self.reserved = Reservations()  # released requests not at their first byte yet
        self.contention = Contention(config.alone_window_s)
        self.tokens_per_request = 1024.0  # EWMA of released uncached prompt tokens
        self.prefill_tps = 0.0  # prefill tokens/s streamed answers showed (0: none yet)
        self.dispatch_rate = 1.0  # EWMA of releases per second while queues formed
        self._last_dispatch = 0.0
        self._tenants: dict[str, tuple[str, float]] = {}  # tenant -> (band, weight) last seen
        self.usage: dict[tuple[str, str], float] = {}  # (model, tenant) -> work not yet shared
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self.config.enabled and self._task is None:
            self._task = asyncio.create_task(self._ticker())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _ticker(self) -> None:
        """Releases what the replicas' scraped signals allow once they change (a slot freed
        by a first byte is pumped at once; a gauge that drops has no event)."""
        while True:
            if not any(q.size for q in self.queues.values()):
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.config.tick_s)
            for model in list(self.queues):
                self.pump(model)

    # -- admission --------------------------------------------------------------------------
    def queue(self, model: str) -> FairQueue[_Waiter]:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = FairQueue(
                max_lead=self.config.history_tokens, burst=self.config.burst_tokens
            )
        return q

    def capacity(self, model: str) -> Capacity | None:
        """None when no replica serves the model (the route answers that, not the queue)."""
        replicas = self.replicas(model)
        if not replicas:
            return None
        return capacity(
            replicas,
            self.reserved.count(model),
            self.config.thresholds,
            self.tokens_per_request,
            self.contention.alone(model, self.clock()),
            self.reserved.tokens(model),
        )

    def saturated(self, model: str) -> bool:
        """Requests of ``model`` wait in the gateway, or no prefill slot is free: a request
        sent again now would take a slot someone waits for (the retry budget's signal)."""
        if not self.config.enabled:
            return False
        q = self.queues.get(model)
        if q is not None and q.size:
            return True
        cap = self.capacity(model)
        return cap is not None and not cap.free

    def in_prefill(self, model: str) -> int:
        return self.reserved.total(model)

    def expected_output(self, max_tokens: int | None, sequences: int = 1) -> int:
        """Output tokens a request may generate: ``max_tokens`` (or the default) per
        sequence."""
        per = max_tokens if max_tokens is not None else self.config.default_output_tokens
        return per * sequences

    def precheck(self, tenant: str, s: FlowSettings, min_tokens: int = 0) -> None:
        """The 429 the rate limits would give now a request of ``tenant`` costing at least
        ``min_tokens``, raised before its prompt is rendered; nothing is counted (``admit``
        counts the exact cost)."""
        if s.rpm is None and s.tpm is None:
            return
        if s.tpm is not None and min_tokens > s.tpm:
            self.metrics.shed.labels(tenant, "rate_too_large").inc()
            raise too_large(min_tokens, s.tpm)
        wait, which, headers = self.limits.peek(tenant, s.rpm, s.tpm, min_tokens, self.clock())
        if which is not None:
            raise self._rate_refusal(tenant, which, wait, headers)

    def _rate_refusal(
        self, tenant: str, which: str, wait: float, headers: dict[str, str]
    ) -> APIError:
        self.metrics.shed.labels(tenant, f"rate_{which}").inc()
        return shed_error(
            f"rate limit reached for {which} per minute; retry after {math.ceil(wait)} s",
            "rate_limit_exceeded",
            wait,
            headers,
        )

    async def admit(
        self,
        req: FlowRequest,
        estimate: Callable[[], Awaitable[Estimate]],
        queued: bool = True,
    ) -> Ticket:
        """A ticket once the request may go to the scheduler; a 429 ``APIError`` when it is
        shed. Cancelled (the client left) while waiting: out of the queue, nothing held.
        ``queued=False``: rate limits only (a request that takes no prefill slot)."""
        s = req.settings
        now = self.clock()
        ticket = Ticket(self, req.model, req.tenant, s.band, s.weight, req.session)
        output = req.output_tokens(self.config.default_output_tokens)
        tokens = req.prompt_tokens + req.batch_tokens + output
        if s.tpm is not None and tokens > s.tpm:
            self.metrics.shed.labels(req.tenant, "rate_too_large").inc()
            raise too_large(tokens, s.tpm)
        wait, which, ticket.headers = self.limits.check(req.tenant, s.rpm, s.tpm, tokens, now)
        if which is not None:
            raise self._rate_refusal(req.tenant, which, wait, ticket.headers)
        if not self.config.enabled or not queued:
            ticket.controller = None  # rate limits only: nothing held, nothing charged
            return ticket
        self._tenants[req.tenant] = (s.band, s.weight)
        self.contention.seen(req.model, req.tenant, now)
        q = self.queue(req.model)
        cap = self.capacity(req.model)
        if cap is None or (q.size == 0 and cap.idle and cap.free):
            # Nothing in prefill and nothing waiting: no lookup, no queue.
            self._take(ticket, None, round(self.tokens_per_request))
            self.metrics.released.labels(s.band, "no").inc()
            return ticket
        # Busy: what the request costs decides its place among its band's tenants, and
        # where its prefix is cached decides which replica's free slot it waits for (it is
        # released at once when one is free).
        uncached, holders, place = await estimate()
        # A batch's other prompts are prefilled too (nobody routes on them: uncached).
        ticket.cost = uncached + req.batch_tokens + self.config.decode_token_cost * output
        ticket.tokens = uncached + req.batch_tokens
        return await self._wait(req, ticket, cap, holders, place)

    async def _wait(
        self,
        req: FlowRequest,
        ticket: Ticket,
        cap: Capacity | None,
        holders: tuple[str, ...],
        place: Place | None = None,
    ) -> Ticket:
        s = req.settings
        q = self.queue(req.model)
        bound = s.max_queue or self.config.max_queue_per_tenant
        if q.tenant_depth(s.band, req.tenant) >= bound:
            self._shed_count(req.tenant, "queue_full")
            raise shed_error(
                f"too many requests of this tenant are waiting ({bound}); retry later",
                "queue_full",
                self._retry_after(q, s.band, req.tenant),
                ticket.headers,
            )
        if q.size >= self.config.max_queue and not self._make_room(q, s.band):
            self._shed_count(req.tenant, "overflow")
            raise shed_error(
                "the gateway's queue is full; retry later",
                "queue_full",
                self._retry_after(q, s.band, req.tenant),
                ticket.headers,
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), ticket, holders, place)
        ahead = q.depth(s.band) + sum(q.depth(b) for b in BANDS if BAND_RANK[b] < BAND_RANK[s.band])
        entry = q.push(
            Entry(waiter, req.tenant, req.session, s.band, ticket.cost, s.weight, self.clock())
        )
        self._gauge(q)
        self._wake.set()
        self.pump(req.model)  # released at once if a replica holding its prefix has room
        if waiter.future.done():
            return ticket
        ticket.why = f"fleet busy ({_describe(cap)}); {ahead} ahead in band {s.band} or higher"
        if holders:
            ticket.why += (
                f"; waits for a slot on one of the {len(holders)} replicas holding its prefix"
            )
        timeout = s.queue_timeout_s or self.config.queue_timeout_s
        t0 = self.clock()
        try:
            await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                ticket.done()  # released just as the client left: give the slot back
            elif q.remove(entry):
                self._gauge(q)
            raise
        finally:
            ticket.queued_s = self.clock() - t0
        if not waiter.future.done():
            if q.remove(entry):
                self._gauge(q)
            if self.contention.alone(req.model, self.clock()):
                # Nobody else waits to be served fairly: vLLM would have kept it waiting in
                # its own queue as long as its client waits, so it goes there, not a 429.
                self._take(ticket, None, ticket.tokens)
                self.metrics.released.labels(s.band, "yes").inc()
                return ticket
            self._shed_count(req.tenant, "queue_timeout")
            raise shed_error(
                f"the request waited {timeout:g} s in the gateway's queue (the fleet is "
                "saturated); retry later",
                "queue_timeout",
                self._retry_after(q, s.band, req.tenant),
                ticket.headers,
            )
        waiter.future.result()  # raises the 429 of a request shed by a higher band
        self.metrics.wait.labels(s.band).observe(ticket.queued_s)
        return ticket

    def _make_room(self, q: FairQueue[_Waiter], band: str) -> bool:
        """The queue is full: shed the newest request of the lowest band below ``band``."""
        for lower in reversed(BANDS):
            if BAND_RANK[lower] <= BAND_RANK[band]:
                return False
            victim = q.newest(lower)
            if victim is not None and q.remove(victim):
                w = victim.item
                self._shed_count(w.ticket.tenant, "overflow")
                w.future.set_exception(
                    shed_error(
                        f"shed for {band} traffic: the gateway's queue is full; retry later",
                        "queue_full",
                        self._retry_after(q, lower, w.ticket.tenant),
                        w.ticket.headers,
                    )
                )
                self._gauge(q)
                return True
        return False

    # -- release ----------------------------------------------------------------------------
    def pump(self, model: str) -> None:
        """Release queued requests in fair order while the model has free prefill slots: a
        request whose prefix is cached waits for a slot on a replica holding it (the
        scheduler will send it there), and lets the next tenant in order take a slot it
        cannot use; a request whose prefix nobody holds takes a slot only on a replica no
        earlier queued request waits for (``Capacity.best_unheld``), and the scheduler is
        told which (``Ticket.replica``)."""
        q = self.queues.get(model)
        if q is None or not q.size:
            return
        while q.size:
            cap = self.capacity(model)
            fit: _Fit | None = None
            if cap is None:
                entry = q.pop()
            elif not cap.free:
                break
            else:
                fit = _Fit(q, cap)
                entry = q.pop(fit)
            if entry is None:
                break
            w = entry.item
            if w.future.done():  # cannot happen (removed entries leave the queue): stay safe
                continue
            self._take(w.ticket, fit.slot(entry) if fit is not None else None, w.ticket.tokens)
            w.ticket.charged = True
            self._count_usage(model, w.ticket.tenant, entry.cost)
            now = self.clock()
            waited = "yes" if now - entry.enqueued_at > 1e-3 else "no"
            self.metrics.released.labels(entry.band, waited).inc()
            if self._last_dispatch:
                gap = max(1e-3, now - self._last_dispatch)
                self.dispatch_rate += 0.1 * (1.0 / gap - self.dispatch_rate)
            self._last_dispatch = now
            w.future.set_result(None)
        self.metrics.saturated.set(1 if q.size else 0)
        self._gauge(q)

    def _take(self, ticket: Ticket, replica: str | None, tokens: int) -> None:
        self.reserved.take(ticket.model, replica, tokens)
        ticket.held, ticket.replica, ticket.tokens = True, replica, tokens
        self.metrics.in_prefill.inc()

    def slot_free(self, model: str, replica: str | None, tokens: int) -> None:
        self.reserved.give_back(model, replica, tokens)
        self.metrics.in_prefill.dec()
        self.pump(model)

    def slot_decided(self, ticket: Ticket, replica: str, uncached: int, output_tokens: int) -> None:
        if ticket.held:  # the slot moves where it was placed, with what it prefills there
            tokens = max(1, uncached)
            self.reserved.move(ticket.model, ticket.replica, replica, ticket.tokens, tokens)
            ticket.replica, ticket.tokens = replica, tokens
        self.tokens_per_request += 0.05 * (max(1, uncached) - self.tokens_per_request)
        if ticket.charged:
            return
        ticket.charged = True
        cost = uncached + self.config.decode_token_cost * output_tokens
        ticket.cost = cost
        self.queue(ticket.model).charge(
            ticket.band, ticket.tenant, cost, ticket.weight, dispatched=True
        )
        self._count_usage(ticket.model, ticket.tenant, cost)

    def _count_usage(self, model: str, tenant: str, cost: float) -> None:
        key = (model, tenant)
        self.usage[key] = self.usage.get(key, 0.0) + cost

    def learn_prefill(self, tps: float) -> None:
        self.prefill_tps = (
            tps if not self.prefill_tps else self.prefill_tps + 0.1 * (tps - self.prefill_tps)
        )

    def charge_remote(self, model: str, tenant: str, cost: float) -> None:
        """Work another gateway did for ``tenant`` (fleet mode): it counts here too."""
        band, weight = self._tenants.get(tenant, ("standard", 1.0))
        self.queue(model).charge(band, tenant, cost, weight, dispatched=False)
        self.contention.seen(model, tenant, self.clock())  # tenants contend fleet-wide
        self.metrics.remote_usage.labels(tenant).inc(cost)

    # -- views ------------------------------------------------------------------------------
    def _shed_count(self, tenant: str, reason: str) -> None:
        self.metrics.shed.labels(tenant, reason).inc()

    def _retry_after(self, q: FairQueue[_Waiter], band: str, tenant: str) -> float:
        """From the caller's own place only: its tenant's requests waiting ahead of it, at
        the rate requests leave the queue. Other tenants' backlog is not counted: a
        Retry-After that moved with it told one tenant how busy the others were."""
        ahead = q.tenant_depth(band, tenant)
        return min(60.0, max(1.0, ahead / max(0.1, self.dispatch_rate)))

    def _gauge(self, q: FairQueue[_Waiter]) -> None:
        for band in BANDS:
            self.metrics.depth.labels(band).set(sum(qq.depth(band) for qq in self.queues.values()))

    def explain(self, model: str, tenant: str, settings: FlowSettings) -> dict[str, Any]:
        """What flow control would do with a request of ``tenant`` for ``model`` now."""
        if not self.config.enabled:
            return {"enabled": False}
        q = self.queue(model)
        cap = self.capacity(model)
        queued = q.size > 0
        saturated = cap is not None and not cap.free
        if cap is None:
            verdict = "passes: no replica serves the model (the route answers that)"
        elif not queued and not saturated:
            verdict = "passes at once: a prefill slot is free and nothing waits"
        else:
            verdict = (
                f"waits in band {settings.band} behind {q.depth(settings.band)} queued of its "
                f"band and {sum(q.depth(b) for b in BANDS if BAND_RANK[b] < BAND_RANK[settings.band])} "
                "of higher bands, in weighted fair order"
            )
        return {
            "enabled": True,
            "verdict": verdict,
            "band": settings.band,
            "weight": settings.weight,
            "tenant_queued": q.tenant_depth(settings.band, tenant),
            "tenant_lead": round(q.lag(settings.band, tenant), 1),
            "queues": q.describe(),
            "capacity": cap.describe() if cap is not None else None,
        }


class _Fit:
    """``pump``'s test of whether a queued entry can go now, and where its slot is. The
    replicas earlier entries wait for are looked up only for an entry whose prefix nobody
    holds (rare: a tenant's first request), once per release."""

    def __init__(self, q: FairQueue[_Waiter], cap: Capacity) -> None:
        self.q, self.cap = q, cap
        self._waiting: Waiting | None = None

    def waiting(self) -> Waiting:
        if self._waiting is None:
            queued = ((e.seq, e.item.holders) for e in self.q.entries())
            self._waiting = Waiting.of(queued, self.cap)
        return self._waiting

    def __call__(self, entry: Entry[_Waiter]) -> bool:
        if self.cap.known(entry.item.holders):
            return self.cap.free_for(entry.item.holders)
        return self.cap.free and self.slot(entry) is not None

    def slot(self, entry: Entry[_Waiter]) -> str | None:
        """The replica whose slot the entry takes (None: its holders are gone; the
        scheduler places it)."""
        holders = entry.item.holders
        if self.cap.known(holders):
            return self.cap.best(holders)
        return self.cap.best_unheld(self.waiting(), entry.seq, entry.item.place)


def _describe(cap: Capacity | None) -> str:
    if cap is None:
        return "no replica"
    text = f"{cap.used:g} of {cap.slots:g} prefill slots busy"
    if cap.blocked:
        text += f", {len(cap.blocked)} replicas full"
    return text
