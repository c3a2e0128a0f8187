"""Lowest cost, ties broken by ring order; a prefix no eligible replica holds goes to its ring
owner (bounded loads), the same on every gateway."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.keys import tie_key
from router.schedule.types import Branch, Cycle, Pick, Picker, ScoredCandidate

WHY = {
    Branch.PREFIX: "the replica holding the longest prefix has the lowest estimated TTFT",
    Branch.SPILL: "a replica holding more of the prefix is too busy (its queue or the load "
    "bound outweighs the prefill saved); this one finishes the prefill sooner",
    Branch.RING: "no replica holds any block of this prefix: its ring owner (bounded loads)",
}


@registry.picker("ring_min_cost")
class RingMinCost(Picker):
    """Invariant: if some eligible candidate holds a block, the eligible one of least cost
    (then ring rank at the tie key, then URL); otherwise the ring's bounded-load pick. The
    reason is ``prefix`` when the chosen one holds the most of anyone, else ``spill``, or
    ``ring`` when nobody holds anything."""

    @dataclass(frozen=True)
    class Params:
        load_bound: float = 1.25  # for the ring walk over cold prefixes

        def __post_init__(self) -> None:
            if self.load_bound < 1.0:
                raise ValueError(f"load_bound must be >= 1.0, got {self.load_bound}")

    name = "ring_min_cost"
    exact_on_head = True  # never reads the prompt length
    uses_index = True

    def __init__(self, params: Params) -> None:
        self.c = params.load_bound

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        best_match = max(s.matched_blocks for s in scored)
        eligible = [s for s in scored if s.filtered is None]
        best_eligible = max(s.matched_blocks for s in eligible)
        # The ring key is the first block the eligible replicas do not all hold: for a fully
        # cold prompt that is block 0; when every replica holds a shared system prompt, it is
        # the first block after it, so conversations behind one system prompt still spread
        # (and land alike on every gateway) instead of all breaking ties the same way.
        key = tie_key(cycle.req, best_eligible)
        loads = {c.url: c.load for c in cycle.candidates}
        ring_choice = cycle.ring.pick(key, loads.__getitem__, [s.url for s in eligible], self.c)
        if best_eligible == 0:  # cold everywhere it may go: the ring decides
            assert ring_choice is not None
            branch = Branch.RING if best_match == 0 else Branch.SPILL
            return Pick(ring_choice, branch, WHY[branch], ring_choice)
        rank = cycle.ring.rank(key)
        chosen = min(eligible, key=lambda s: (s.cost, rank.get(s.url, len(rank)), s.url))
        most = max(s.weighted_blocks for s in scored)  # an offloaded block at its weight
        branch = Branch.PREFIX if chosen.weighted_blocks == most else Branch.SPILL
        return Pick(chosen.url, branch, WHY[branch], ring_choice)
