"""A prefix's replica set bounded by its share of recent requests.

Under pressure a spill copies a long prefix onto a new replica: its whole prefill there, and
as many cached blocks of other tenants evicted. That pays off only for a prefix whose traffic
needs another replica. So a prefix may occupy about ``factor x share x replicas`` replicas
(at least 1), its share being its decayed fraction of the requests this pipeline placed:
once that many candidates hold its first block, the others are not eligible, and a spill
goes to another holder (or the request stays). A cold tenant's set is one replica, so it
stays where its prefix is cached; the hot tenant's set grows with its traffic and shrinks as
it cools (its extra copies age out of the index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.recent import PrefixRates
from router.schedule.types import Cycle, Decision, Filter, Hook


@registry.filter("replica_set_bound")
class ReplicaSetBound(Filter):
    """Invariant: with ``share = (count(prefix) + 1) / (total + 1)`` (decayed counts of placed
    requests, this one included) and ``allowed = max(1, ceil(factor x share x n))`` over the
    ``n`` candidates: if at least ``allowed`` candidates hold the prompt's first block, every
    candidate that does not is removed; otherwise nothing is removed."""

    @dataclass(frozen=True)
    class Params:
        factor: float = 1.0  # replicas per "fair share" of traffic a prefix may occupy
        half_life_s: float = 30.0  # of the per-prefix request counts

        def __post_init__(self) -> None:
            if self.factor <= 0:
                raise ValueError(f"factor must be > 0, got {self.factor}")
            if self.half_life_s <= 0:
                raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")

    name = "replica_set_bound"
    exact_on_head = True  # never reads the prompt length
    hooks = frozenset({Hook.PLACED})  # counts each placed request of its prefix
    reason = "the prefix's replica set is at the bound its request rate sets"
    uses_index = True
    uses_recent = True  # its clock is the pipeline's (virtual in the simulation)

    def __init__(self, params: Params) -> None:
        self.p = params
        self.rates = PrefixRates(params.half_life_s)

    def allowed(self, cycle: Cycle) -> int:
        now = cycle.recent.clock()
        key = cycle.key
        share = (self.rates.count(key, now) + 1.0) / (self.rates.total(now) + 1.0)
        return max(1, math.ceil(self.p.factor * share * len(cycle.candidates) - 1e-9))

    def remove(self, cycle: Cycle) -> set[str]:
        # cycle.held(c) > 0, inline: a prompt with a cacheable block, a candidate with one
        holders = (
            {c.url for c in cycle.candidates if c.matched_blocks > 0} if cycle.limit > 0 else set()
        )
        if not holders or len(holders) < self.allowed(cycle):
            return set()
        return {c.url for c in cycle.candidates} - holders

    def placed(self, decision: Decision, now: float) -> None:
        self.rates.add(decision.prefix_key, now)
