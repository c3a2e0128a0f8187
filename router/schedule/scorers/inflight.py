"""Requests in flight to the replica: in the TTFT cost, each one decoding slows a prefill by
about ``decode_cost_tokens`` prompt tokens' worth (its weight there)."""

from __future__ import annotations

import router.schedule.registry as registry
from router.schedule.types import Candidate, Cycle, NoParams, Scorer


@registry.scorer("inflight")
class Inflight(Scorer):
    """Invariant: the replica's requests in flight from all gateways (``Candidate.load``), a
    count; the weight turns it into tokens."""

    Params = NoParams
    name = "inflight"
    exact_on_head = True  # its terms are integers (counts)

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return c.load
