"""Bounded load on requests in flight now (bursts)."""

from __future__ import annotations

from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.ring import load_bound
from router.schedule.types import Cycle, Filter


@registry.filter("load_bound")
class LoadBound(Filter):
    """Invariant: a candidate whose in-flight requests, plus this one, would exceed
    ``ceil(load_bound x mean) + LOAD_SLACK`` is removed; the mean is over all candidates."""

    @dataclass(frozen=True)
    class Params:
        load_bound: float = 1.25  # c: the multiple of the mean load a replica may carry

        def __post_init__(self) -> None:
            if self.load_bound < 1.0:
                raise ValueError(f"load_bound must be >= 1.0, got {self.load_bound}")

    name = "load_bound"
    exact_on_head = True  # never reads the prompt length
    reason = "over load bound"

    def __init__(self, params: Params) -> None:
        self.c = params.load_bound

    def remove(self, cycle: Cycle) -> set[str]:
        bound = load_bound(self.c, [c.load for c in cycle.candidates])
        return {c.url for c in cycle.candidates if c.load + 1 > bound}
