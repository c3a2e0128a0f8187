"""Whether a model's replicas can start another request soon, from their own signals.

vLLM serves its waiting queue first come, first served, and nothing can reorder a request once
it sits there; so the gateway releases work only while some replica has room to start it:
about ``prefill_per_replica`` requests in prefill per replica (sent, no first byte yet). A
replica is left out entirely while its own gauges say it is full -- ``vllm:num_requests_waiting``
at or over ``waiting_max`` (someone else filled its queue), ``vllm:kv_cache_usage_perc`` at
or over ``kv_usage_max`` (new work would preempt), or an observed time to first byte of
mostly cached requests over ``ttft_max_s`` (0: not used). Other gateways' requests in prefill
(fleet mode) take their share of the slots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ReplicaView(Protocol):
    """What the judge reads of ``router.fleet.Replica``."""

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


@dataclass(frozen=True, slots=True)
class Capacity:
    slots: float  # requests the usable replicas may have in prefill
    used: float  # in prefill now: this gateway's plus the others' estimate
    blocked: dict[str, str]  # replica -> why it takes nothing now

    @property
    def free(self) -> bool:
        return self.used < self.slots

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_slots": self.slots,
            "in_prefill": self.used,
            "saturated": not self.free,
            "blocked_replicas": dict(self.blocked),
        }


def blocked_reason(r: ReplicaView, t: Thresholds) -> str | None:
    if r.stats.waiting >= t.waiting_max:
        return f"vllm waiting {r.stats.waiting} >= {t.waiting_max}"
    if r.stats.kv_usage >= t.kv_usage_max:
        return f"kv usage {r.stats.kv_usage:.2f} >= {t.kv_usage_max:g}"
    if t.ttft_max_s > 0 and (ttft := r.ttft.get()) >= t.ttft_max_s:
        return f"observed ttft {ttft:.2f}s >= {t.ttft_max_s:g}s"
    return None


def capacity(
    replicas: Sequence[ReplicaView], in_prefill: float, t: Thresholds, tokens_per_request: float
) -> Capacity:
    """The model's prefill slots and how many are taken. ``in_prefill``: this gateway's own
    requests released and not yet at their first byte; another gateway's queued prefill
    tokens count as ``ceil(tokens / tokens_per_request)`` requests."""
    blocked: dict[str, str] = {}
    slots = 0.0
    remote = 0.0
    for r in replicas:
        if r.remote_prefill_tokens > 0:
            remote += math.ceil(r.remote_prefill_tokens / max(1.0, tokens_per_request))
        why = blocked_reason(r, t)
        if why is None:
            slots += t.prefill_per_replica
        else:
            blocked[r.url] = why
    return Capacity(slots, in_prefill + remote, blocked)
