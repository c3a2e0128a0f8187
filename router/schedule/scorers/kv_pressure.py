"""How full the replica's KV cache is, from its scraped ``vllm:kv_cache_usage_perc``."""

from __future__ import annotations

import router.schedule.registry as registry
from router.schedule.types import Candidate, Cycle, NoParams, Scorer


@registry.scorer("kv_pressure")
class KvPressure(Scorer):
    """Invariant: the replica's last scraped KV-cache usage, 0 (empty) to 1 (full). A full
    cache preempts or queues new work and evicts prefixes; the weight says how many prompt
    tokens of prefill a full cache is worth avoiding."""

    Params = NoParams
    name = "kv_pressure"

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return min(max(c.kv_usage, 0.0), 1.0)
