"""A sticky baseline: always the replica holding the longest prefix, whatever its queue.

Like a cache-aware router without a balance threshold (SGLang's gateway under a hot prefix):
it keeps almost every hit and lets the hot tenant's replica queue; a cold prefix goes to
the least loaded. For A/B runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import router.schedule.registry as registry
from router.schedule.keys import tie_key
from router.schedule.types import Branch, Cycle, NoParams, Pick, Picker, ScoredCandidate


@registry.picker("sticky_prefix")
class StickyPrefix(Picker):
    """Invariant: the eligible candidate with the most reusable blocks, ties by ring rank at
    the tie key; a prefix nobody holds goes to the one with fewest requests in flight (as
    SGLang's gateway sends a low match to its least-used worker), ties by ring rank."""

    Params = NoParams
    name = "sticky_prefix"
    exact_on_head = True  # never reads the prompt length
    uses_index = True

    def __init__(self, params: NoParams) -> None:
        pass

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        eligible = [s for s in scored if s.filtered is None]
        best = max(s.matched_blocks for s in eligible)
        rank = cycle.ring.rank(tie_key(cycle.req, best))
        if best == 0:
            cold = min(eligible, key=lambda s: (s.load, rank.get(s.url, len(rank)), s.url))
            return Pick(cold.url, Branch.RING, "no replica holds this prefix: the least loaded")
        chosen = min(
            eligible, key=lambda s: (-s.weighted_blocks, rank.get(s.url, len(rank)), s.url)
        )
        return Pick(chosen.url, Branch.PREFIX, "the replica holding the longest prefix, always")
