"""A uniformly random eligible replica."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.types import Cycle, Pick, Picker, ScoredCandidate


@registry.picker("random")
class RandomPick(Picker):
    """Invariant: every eligible replica is equally likely; ``seed`` makes the draws
    repeatable."""

    @dataclass(frozen=True)
    class Params:
        seed: int | None = None

    name = "random"
    exact_on_head = True  # never reads the prompt length

    def __init__(self, params: Params) -> None:
        self._rng = random.Random(params.seed)

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        url = self._rng.choice([s.url for s in scored if s.filtered is None])
        return Pick(url, None, "a replica drawn at random")
