"""The lowest cost, ties broken at random (never always the first)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.types import Cycle, Pick, Picker, ScoredCandidate


@registry.picker("random_min")
class RandomMin(Picker):
    """Invariant: an eligible candidate of least cost, each of the tied ones equally likely;
    ``seed`` makes the draws repeatable."""

    @dataclass(frozen=True)
    class Params:
        seed: int | None = None

    name = "random_min"
    exact_on_head = True  # never reads the prompt length

    def __init__(self, params: Params) -> None:
        self._rng = random.Random(params.seed)

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        eligible = [s for s in scored if s.filtered is None]
        low = min(s.cost for s in eligible)
        chosen = self._rng.choice([s for s in eligible if s.cost == low])
        return Pick(chosen.url, None, "the lowest cost (fewest in flight); ties at random")
