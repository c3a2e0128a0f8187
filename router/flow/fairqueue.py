"""Weighted fair queuing over bands, tenants and sessions: a pure data structure (no clock,
no I/O), so the dispatch order can be pinned by unit tests.

Start-time fair queuing (Goyal et al.): every flow keeps the virtual time its last request
finished (``finish``); a flow that becomes backlogged starts at ``max(v, finish)``, where
``v`` is the start tag of the last request dispatched; the backlogged flow with the least
start tag goes next, and its finish advances by ``cost / weight``. A tenant that sends long
uncached prompts advances faster and so waits longer: fairness is on work, not on requests.

Two levels: tenants within a band, weighted by the tenant's weight; sessions within a
tenant take turns by request, so one agent session cannot starve the tenant's others. The
work is the tenant's (its tag pays for it); a session's past is forgotten once it has nothing
queued: charged by cost and remembered, the session that happened to carry the tenant's
first, uncached request (its system prompt, cached for all its sessions after) was held
behind the tenant's other sessions' later requests for tens of seconds (traced in the
noisy-neighbour benchmark: a quiet request overtaken by six of its tenant's later ones).
A session that becomes backlogged starts no earlier than the tenant's session at the head
(the least start tag waiting): with their pasts forgotten, sessions sending one request at a
time each started at the tenant's virtual time, one turn before a session that had two
queued, and went ahead of its second request as long as they kept coming (traced: a request
overtaken by three later ones of its tenant and queued 6.4 s in the first contacts).
Bands are strict priority: nothing of a lower band leaves while a higher band has a
request queued.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

BANDS = ("critical", "standard", "sheddable")  # highest priority first
BAND_RANK = {b: i for i, b in enumerate(BANDS)}

T = TypeVar("T")


@dataclass(eq=False)
class Entry(Generic[T]):
    """One queued request: ``item`` is the caller's; the tags are for explain."""

    item: T
    tenant: str
    session: str
    band: str
    cost: float
    weight: float
    enqueued_at: float
    seq: int = 0
    removed: bool = False


@dataclass(eq=False)
class _Flow(Generic[T]):
    """A tenant's (or, inside a tenant, a session's) queue and its finish tag."""

    finish: float = 0.0
    start: float = 0.0  # while backlogged: the start tag of its head
    version: int = 0  # a new, unique one when its heap entry goes stale
    queue: deque[Entry[T]] = field(default_factory=deque)  # sessions only
    sessions: dict[str, _Flow[T]] = field(default_factory=dict)  # tenants only
    heap: list[tuple[float, int, str, int]] = field(default_factory=list)  # tenants: sessions
    vtime: float = 0.0  # tenants: the session-level virtual time
    size: int = 0  # queued entries (a tenant: over all its sessions)


class _Band(Generic[T]):
    def __init__(self) -> None:
        self.vtime = 0.0
        self.tenants: dict[str, _Flow[T]] = {}
        self.heap: list[tuple[float, int, str, int]] = []
        self.tops: list[tuple[float, int, str, int]] = []  # the same, tags negated (max first)
        self.size = 0


class FairQueue(Generic[T]):
    """Bands of tenant flows of session flows. ``push`` queues, ``pop`` returns the next
    entry in fair order, ``remove`` takes one out (its client left, or its deadline passed).
    ``charge`` accounts work dispatched around the queue (the fast path while unsaturated,
    or another gateway's usage) so a tenant's history counts when the queue forms.

    ``max_lead``: how far (in virtual time, cost per weight) a tenant's finish tag may run
    ahead of its band's virtual time through ``charge``; it bounds how long past usage can
    hold a tenant back.

    ``burst``: how much work (cost) a tenant that was using less than its share may send
    ahead of the band when it becomes backlogged again. Plain start-time fair queuing starts
    it at the band's virtual time, so a quiet tenant's burst of three requests alternates
    with a flooding tenant's on the replica they share (measured: quiet requests waited 1-3 s
    behind the flood in the noisy-neighbour benchmark); with credit they go first. The credit
    is earned only by falling behind the band's virtual time (being under one's share), and
    is bounded, so a tenant that is always backlogged gains nothing from it."""

    def __init__(
        self, max_lead: float = float("inf"), max_idle: int = 4096, burst: float = 0.0
    ) -> None:
        self.bands: dict[str, _Band[T]] = {b: _Band() for b in BANDS}
        self.max_lead = max_lead
        self.burst = burst
        self.max_idle = max_idle
        self._seq = itertools.count()
        self.size = 0

    # -- queueing ---------------------------------------------------------------------------
    def push(self, entry: Entry[T]) -> Entry[T]:
        band = self.bands[entry.band]
        entry.seq = next(self._seq)
        tenant = self._tenant(band, entry.tenant)
        session = tenant.sessions.get(entry.session)
        if session is None:
            session = tenant.sessions[entry.session] = _Flow()
        session.queue.append(entry)
        session.size += 1
        if session.size == 1:  # newly backlogged session: its past is forgotten
            session.start = tenant.vtime
            if tenant.size:  # but it does not go before the tenant's longest-waiting one
                session.start = max(session.start, self._head_session(tenant)[1].start)
            self._push_session(tenant, entry.session, session)
        tenant.size += 1
        if tenant.size == 1:  # newly backlogged tenant
            tenant.start = self._lift(band, tenant, entry.weight)
            self._push_tenant(band, entry.tenant, tenant)
        band.size += 1
        self.size += 1
        return entry

    def _tenant(self, band: _Band[T], name: str) -> _Flow[T]:
        tenant = band.tenants.get(name)
        if tenant is None:  # a tenant not seen (or forgotten) has earned no credit
            tenant = band.tenants[name] = _Flow(finish=band.vtime)
        return tenant

    def _lift(self, band: _Band[T], tenant: _Flow[T], weight: float) -> float:
        """Where a tenant that was idle starts: where its past work left it, but at most
        ``burst`` (per weight) behind the band's virtual time."""
        return max(band.vtime - self.burst / weight, tenant.finish)

    def _push_session(self, tenant: _Flow[T], name: str, s: _Flow[T]) -> None:
        s.version = next(self._seq)  # unique: a forgotten flow's entries never match again
        heapq.heappush(tenant.heap, (s.start, s.version, name, s.version))

    def _push_tenant(self, band: _Band[T], name: str, t: _Flow[T]) -> None:
        t.version = seq = next(self._seq)
        heapq.heappush(band.heap, (t.start, seq, name, t.version))
        if self.burst:
            heapq.heappush(band.tops, (-t.start, seq, name, t.version))
            if len(band.tops) > 64 + 2 * len(band.heap):  # stale entries buried under the top
                band.tops = [x for x in band.tops if self._valid(band, x)]
                heapq.heapify(band.tops)

    @staticmethod
    def _valid(band: _Band[T], item: tuple[float, int, str, int]) -> bool:
        tenant = band.tenants.get(item[2])
        return tenant is not None and tenant.version == item[3] and tenant.size > 0

    def _top(self, band: _Band[T]) -> float:
        """The highest start tag of a backlogged tenant (the busiest's), or the band's
        virtual time if that is higher."""
        while band.tops and not self._valid(band, band.tops[0]):
            heapq.heappop(band.tops)
        return max(band.vtime, -band.tops[0][0]) if band.tops else band.vtime

    def peek_band(self) -> str | None:
        """The band the next ``pop`` takes from."""
        for name in BANDS:
            if self.bands[name].size:
                return name
        return None

    def pop(
        self, eligible: Callable[[Entry[T]], bool] | None = None, max_scan: int = 64
    ) -> Entry[T] | None:
        """The next entry in fair order (None if none). With ``eligible``, a tenant whose
        next entry cannot go now (its replica is busy) is passed over, keeping its place,
        for the next tenant in order (at most ``max_scan`` tenants a band); a lower band is
        looked at only when no entry of the higher ones can go.

        With credit (``burst``), the tenants whose start tag is below the busiest's (the
        highest backlogged tag, or the band's virtual time if higher) go first come, first
        served among themselves, as the replica would have served them: ordering them by
        tag would only move waiting from one light tenant to another. The busiest goes when
        none of them can."""
        for name in BANDS:
            band = self.bands[name]
            if not band.size:
                continue
            skipped: list[tuple[float, int, str, int]] = []
            best: tuple[tuple[float, int, str, int], _Flow[T], str, _Flow[T]] | None = None
            top = self._top(band) if self.burst else 0.0
            try:
                while band.heap and len(skipped) < max_scan:
                    item = heapq.heappop(band.heap)
                    tenant = band.tenants.get(item[2])
                    if tenant is None or tenant.version != item[3] or not tenant.size:
                        continue  # stale
                    sname, session = self._head_session(tenant)
                    head = session.queue[0]
                    light = self.burst > 0 and item[0] < top
                    if best is not None and not light:
                        skipped.append(item)  # the light ones come first
                        break
                    if eligible is not None and not eligible(head):
                        skipped.append(item)
                    elif not light:
                        return self._dispatch(band, item[0], item[2], tenant, sname, session)
                    elif best is None or head.seq < best[3].queue[0].seq:
                        if best is not None:
                            skipped.append(best[0])
                        best = (item, tenant, sname, session)
                    else:
                        skipped.append(item)
                if best is not None:
                    item, tenant, sname, session = best
                    best = None
                    return self._dispatch(band, item[0], item[2], tenant, sname, session)
            finally:
                if best is not None:
                    skipped.append(best[0])
                for item in skipped:
                    heapq.heappush(band.heap, item)
        return None

    def _head_session(self, tenant: _Flow[T]) -> tuple[str, _Flow[T]]:
        while True:
            _, _, sname, sversion = tenant.heap[0]
            session = tenant.sessions.get(sname)
            if session is not None and session.version == sversion and session.size:
                return sname, session
            heapq.heappop(tenant.heap)  # stale

    def _dispatch(
        self,
        band: _Band[T],
        start: float,
        tname: str,
        tenant: _Flow[T],
        sname: str,
        session: _Flow[T],
    ) -> Entry[T]:
        heapq.heappop(tenant.heap)  # the head session's entry, found by _head_session
        entry = session.queue.popleft()
        # Session level: turns by request inside the tenant (its work is the tenant's).
        tenant.vtime = max(tenant.vtime, session.start)
        session.finish = session.start + 1.0
        session.size -= 1
        if session.size:
            session.start = session.finish
            self._push_session(tenant, sname, session)
        else:  # idle: nothing to remember (its heap entry was the one popped)
            del tenant.sessions[sname]
        # Tenant level: weighted.
        band.vtime = max(band.vtime, start)
        tenant.finish = start + entry.cost / entry.weight
        tenant.size -= 1
        band.size -= 1
        self.size -= 1
        if tenant.size:
            tenant.start = tenant.finish
            self._push_tenant(band, tname, tenant)
        self._prune(band, tname, tenant)
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take ``entry`` out (a client that left, a deadline): False if it already left."""
        if entry.removed:
            return False
        band = self.bands[entry.band]
        tenant = band.tenants.get(entry.tenant)
        session = tenant.sessions.get(entry.session) if tenant else None
        if tenant is None or session is None:
            return False
        try:
            session.queue.remove(entry)
        except ValueError:
            return False
        entry.removed = True
        session.size -= 1
        tenant.size -= 1
        band.size -= 1
        self.size -= 1
        if not session.size:  # its heap entry is stale (versions are never reused)
            del tenant.sessions[entry.session]
        if not tenant.size:
            tenant.version = next(self._seq)
        self._prune(band, entry.tenant, tenant)
        return True

    def _prune(self, band: _Band[T], name: str, tenant: _Flow[T]) -> None:
        """An idle tenant whose finish is in the past remembers nothing worth keeping. Idle
        tenants still ahead (their last request's cost, or work another gateway reported)
        are kept, at most ``max_idle`` of them: beyond, those least ahead are forgotten."""
        if not tenant.size and tenant.finish <= band.vtime and not self.burst:
            band.tenants.pop(name, None)  # (with credit, kept: its credit is its past)
        if len(band.tenants) > self.max_idle + band.size:
            idle = sorted((t.finish, n) for n, t in band.tenants.items() if not t.size)
            for _, n in idle[: len(band.tenants) - self.max_idle - band.size]:
                del band.tenants[n]

    # -- accounting -------------------------------------------------------------------------
    def charge(
        self, band_name: str, tenant_name: str, cost: float, weight: float, *, dispatched: bool
    ) -> None:
        """Work of ``tenant_name`` done without passing through the queue: its finish tag
        advances by ``cost / weight``, at most ``max_lead`` ahead of the band's virtual time.
        ``dispatched``: this gateway sent it (the fast path while unsaturated), which moves
        the band's clock as a release would; work another gateway did does not."""
        if cost <= 0:
            return
        band = self.bands[band_name]
        tenant = self._tenant(band, tenant_name)
        start = self._lift(band, tenant, weight)
        tenant.finish = min(start + cost / weight, band.vtime + self.max_lead)
        if dispatched and not tenant.size:
            band.vtime = max(band.vtime, min(start, tenant.finish))
        self._prune(band, tenant_name, tenant)

    # -- views ------------------------------------------------------------------------------
    def depth(self, band: str | None = None) -> int:
        return self.size if band is None else self.bands[band].size

    def tenant_depth(self, band: str, tenant: str) -> int:
        flow = self.bands[band].tenants.get(tenant)
        return flow.size if flow else 0

    def entries(self) -> Iterator[Entry[T]]:
        for band in self.bands.values():
            for tenant in band.tenants.values():
                for session in tenant.sessions.values():
                    yield from session.queue

    def newest(self, band: str) -> Entry[T] | None:
        """The most recently queued entry of ``band`` (what overflow sheds first)."""
        best: Entry[T] | None = None
        for tenant in self.bands[band].tenants.values():
            for session in tenant.sessions.values():
                if session.queue and (best is None or session.queue[-1].seq > best.seq):
                    best = session.queue[-1]
        return best

    def lag(self, band: str, tenant: str) -> float:
        """How far the tenant's finish tag is ahead of its band's virtual time (0: none)."""
        b = self.bands[band]
        flow = b.tenants.get(tenant)
        return max(0.0, flow.finish - b.vtime) if flow else 0.0

    def describe(self) -> dict[str, Any]:
        return {
            name: {"queued": b.size, "virtual_time": round(b.vtime, 3)}
            for name, b in self.bands.items()
        }
