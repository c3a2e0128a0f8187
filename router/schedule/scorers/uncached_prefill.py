"""Prompt tokens the replica would have to prefill: those its prefix cache does not hold."""

from __future__ import annotations

import router.schedule.registry as registry
from router.schedule.types import Candidate, Cycle, NoParams, Scorer


@registry.scorer("uncached_prefill")
class UncachedPrefill(Scorer):
    """Invariant: ``prompt tokens - reusable blocks x block size``, in tokens; reusable blocks
    are the index's match capped at the prompt's cacheable blocks, so it is never negative.
    A block only an offload tier holds counts ``offload_weight`` of a GPU block (vLLM loads
    it over the host link instead of computing it), rounded to whole tokens: the terms stay
    integers."""

    Params = NoParams
    name = "uncached_prefill"
    exact_on_head = True  # its terms are integers (counts)
    uses_index = True

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, cycle: Cycle, c: Candidate) -> float:
        req = cycle.req
        if c.offloaded_blocks:
            return req.num_tokens - round(cycle.tiered(c)[1] * req.block_size)
        return req.num_tokens - min(c.matched_blocks, cycle.limit) * req.block_size  # held(c)
