"""Whether a model's replicas can start another request soon, from their own signals.

vLLM serves its waiting queue first come, first served, and nothing can reorder a request once
it sits there; so the gateway releases work only while some replica has room to start it:
about ``prefill_per_replica`` requests in prefill per replica (sent, no first byte yet). A
replica is left out entirely while its own gauges say it is full -- ``vllm:num_requests_waiting``
at or over ``waiting_max`` (someone else filled its queue), ``vllm:kv_cache_usage_perc`` at
or over ``kv_usage_max`` (new work would preempt), or an observed time to first byte of
mostly cached requests over ``ttft_max_s`` (0: not used). Other gateways' requests in prefill
(fleet mode) take their share of the slots.

While one tenant is alone on the model (``alone``), nobody waits to be treated fairly and the
gate is as wide as vLLM's own step: a replica takes requests while what is in prefill there
comes to less than ``step_tokens`` uncached prompt tokens (vLLM's ``max_num_batched_tokens``:
the waiting requests one scheduler step admits together; v1/core/sched/scheduler.py, the
waiting loop while ``token_budget > 0``), and at least one. A tenant alone is then served as
fast as vLLM can take its requests, and ``ring_spill`` sees a holder's queue grow as it would
without flow control.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ReplicaView(Protocol):
    """What the judge reads of ``router.fleet.replicas.Replica``."""

    url: str
    remote_prefill_tokens: int

    @property
    def stats(self) -> Any: ...  # .waiting, .kv_usage

    @property
    def ttft(self) -> Any: ...  # .get()


@dataclass(frozen=True, slots=True)
class Thresholds:
    prefill_per_replica: float = 1.0
    waiting_max: int = 4
    kv_usage_max: float = 0.95
    ttft_max_s: float = 0.0
    step_tokens: int = 2048  # vLLM's max_num_batched_tokens (its default, under 70 GB / A100)


@dataclass(frozen=True, slots=True)
class Capacity:
    free_by_replica: dict[str, float]  # usable replica -> prefill slots free on it
    unplaced: float  # released requests whose replica is not decided yet
    slots: float  # requests the usable replicas may have in prefill
    used: float  # in prefill now: this gateway's plus the others' estimate
    blocked: dict[str, str]  # replica -> why it takes nothing now
    alone: bool = False  # one tenant only: the step-wide gate, and its prefix may spill

    @property
    def idle(self) -> bool:
        """Nothing of this gateway's in prefill anywhere."""
        return self.used == 0

    @property
    def room(self) -> float:
        return sum(max(0.0, f) for f in self.free_by_replica.values()) - self.unplaced

    @property
    def free(self) -> bool:
        return self.room > 0

    def free_for(self, holders: Sequence[str]) -> bool:
        """Room for a request whose prefix ``holders`` hold: a free slot on one of them (the
        scheduler sends it there; a holder full by its own gauges makes it wait too), or
        anywhere when it has no holder or none serves any more. A tenant alone takes any
        free slot: the scheduler keeps it on a holder or spills it, by its own rule, as it
        would without flow control."""
        if not self.free:
            return False
        if self.alone:
            return True
        known = self.known(holders)
        return not known or any(self.free_by_replica.get(h, 0.0) > 0 for h in known)

    def known(self, holders: Sequence[str]) -> list[str]:
        """The holders that still serve the model (none: the request may go anywhere)."""
        return [h for h in holders if h in self.free_by_replica or h in self.blocked]

    def best(self, holders: Sequence[str]) -> str | None:
        """The holder with the most free slots (None: no usable holder)."""
        usable = [h for h in holders if self.free_by_replica.get(h, 0.0) > 0]
        return max(usable, key=lambda h: self.free_by_replica[h]) if usable else None

    def best_unheld(
        self, waiting: Waiting, seq: int, place: Callable[[list[str]], str] | None = None
    ) -> str | None:
        """Where a request whose prefix nobody holds (queued as ``seq``) may take a slot: a
        free replica no earlier queued request is waiting for, among those the fewest wait for
        (then with the most free slots) the one ``place`` picks (the scheduler's own choice
        for the request among them: the picker's rule for a prefix nobody holds), else the
        first by name; None if there is none. A request that can go anywhere does not take the
        one replica an earlier request must wait for: its prefill (a prefix's first, uncached)
        would hold every request queued for that replica."""
        free = self.free_by_replica
        usable = [u for u, f in free.items() if f > 0 and waiting.oldest.get(u, math.inf) > seq]
        if not usable:
            return None
        low = min((waiting.count.get(u, 0), -free[u]) for u in usable)
        tied = sorted(u for u in usable if (waiting.count.get(u, 0), -free[u]) == low)
        if place is None or len(tied) == 1:
            return tied[0]
        return place(tied)

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_slots": self.slots,
            "in_prefill": self.used,
            "saturated": not self.free,
            "free_by_replica": dict(self.free_by_replica),
            "blocked_replicas": dict(self.blocked),
        }


@dataclass(slots=True)
class Waiting:
    """Queued requests per replica holding their prefix: the oldest one's queue order, and
    how many."""

    oldest: dict[str, int]
    count: dict[str, int]

    @classmethod
    def of(cls, queued: Iterable[tuple[int, Sequence[str]]], cap: Capacity) -> Waiting:
        """From ``(seq, holders)`` of every queued request."""
        oldest: dict[str, int] = {}
        count: dict[str, int] = {}
        for seq, holders in queued:
            for h in cap.known(holders):
                oldest[h] = min(oldest.get(h, seq), seq)
                count[h] = count.get(h, 0) + 1
        return cls(oldest, count)


def blocked_reason(r: ReplicaView, t: Thresholds) -> str | None:
    if r.stats.waiting >= t.waiting_max:
        return f"vllm waiting {r.stats.waiting} >= {t.waiting_max}"
    if r.stats.kv_usage >= t.kv_usage_max:
        return f"kv usage {r.stats.kv_usage:.2f} >= {t.kv_usage_max:g}"
    if t.ttft_max_s > 0 and (ttft := r.ttft.get()) >= t.ttft_max_s:
        return f"observed ttft {ttft:.2f}s >= {t.ttft_max_s:g}s"
    return None


def capacity(
    replicas: Sequence[ReplicaView],
    reserved: Mapping[str | None, int],
    t: Thresholds,
    tokens_per_request: float,
    alone: bool = False,
    reserved_tokens: Mapping[str | None, int] | None = None,
) -> Capacity:
    """The model's prefill slots and how many are taken. ``reserved``: this gateway's own
    requests released and not yet at their first byte, per replica (None: not placed yet);
    another gateway's queued prefill tokens count as ``ceil(tokens / tokens_per_request)``
    requests. ``alone``: one tenant only; a replica's room is then the share of
    ``t.step_tokens`` that its requests in prefill (``reserved_tokens``, and the other
    gateways') leave, one request at least."""
    blocked: dict[str, str] = {}
    free: dict[str, float] = {}
    slots = used = 0.0
    for r in replicas:
        remote = 0.0
        if r.remote_prefill_tokens > 0:
            remote = math.ceil(r.remote_prefill_tokens / max(1.0, tokens_per_request))
        busy = reserved.get(r.url, 0) + remote
        used += busy
        why = blocked_reason(r, t)
        if why is None and alone:
            slots += 1
            tokens = (reserved_tokens or {}).get(r.url, 0) + r.remote_prefill_tokens
            free[r.url] = 1.0 if busy == 0 else 1.0 - tokens / max(1, t.step_tokens)
        elif why is None:
            slots += t.prefill_per_replica
            free[r.url] = t.prefill_per_replica - busy
        else:
            blocked[r.url] = why
    unplaced = float(reserved.get(None, 0))
    if alone and unplaced:  # counted as what they will prefill, as the placed ones are
        unplaced = (reserved_tokens or {}).get(None, 0) / max(1, t.step_tokens)
    return Capacity(free, unplaced, slots, used + unplaced, blocked, alone)
