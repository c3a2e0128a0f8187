"""The prefix's ring owner with bounded loads, ignoring the cache (``consistent_hash``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.types import Cycle, Pick, Picker, ScoredCandidate


@registry.picker("ring_owner")
class RingOwner(Picker):
    """Invariant: the first eligible replica clockwise from the request's block-0 key whose
    in-flight load, plus this request, stays within the bound; the least loaded if none."""

    @dataclass(frozen=True)
    class Params:
        load_bound: float = 1.25

        def __post_init__(self) -> None:
            if self.load_bound < 1.0:
                raise ValueError(f"load_bound must be >= 1.0, got {self.load_bound}")

    name = "ring_owner"
    exact_on_head = True  # never reads the prompt length

    def __init__(self, params: Params) -> None:
        self.c = params.load_bound

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        loads = {s.url: s.load for s in scored if s.filtered is None}
        url = cycle.ring.pick(cycle.key, loads.__getitem__, loads, self.c)
        assert url is not None
        return Pick(url, None, "the prefix's ring owner (bounded loads); the cache is ignored", url)
