"""Each eligible replica in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import router.schedule.registry as registry
from router.schedule.types import Cycle, NoParams, Pick, Picker, ScoredCandidate


@registry.picker("round_robin")
class RoundRobin(Picker):
    """Invariant: the n-th decision (explain included) takes the eligible replica at
    ``n mod len`` in URL order."""

    Params = NoParams
    name = "round_robin"
    exact_on_head = True  # never reads the prompt length

    def __init__(self, params: NoParams) -> None:
        self._counter = itertools.count()

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        ordered = sorted(s.url for s in scored if s.filtered is None)
        return Pick(ordered[next(self._counter) % len(ordered)], None, "the next replica in turn")
