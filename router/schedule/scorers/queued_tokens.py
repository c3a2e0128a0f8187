"""Prompt tokens already queued ahead on the replica."""

from __future__ import annotations

import router.schedule.registry as registry
from router.schedule.types import Candidate, Cycle, NoParams, Scorer


@registry.scorer("queued_tokens")
class QueuedTokens(Scorer):
    """Invariant: the prompt tokens sent to the replica (by every gateway) that have not had
    their first byte back yet, in tokens."""

    Params = NoParams
    name = "queued_tokens"
    exact_on_head = True  # its terms are integers (counts)

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return c.pending_prefill_tokens
