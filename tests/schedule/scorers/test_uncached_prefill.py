from __future__ import annotations

from router.schedule import Candidate, HashRing, PluginSpec, registry
from router.schedule.recent import RecentCounts
from router.schedule.types import Cycle
from tests.schedule.common import req


def test_counts_the_tokens_not_held_and_never_goes_negative():
    s = registry.plugin("scorer", PluginSpec("uncached_prefill"))
    r = req(100)  # 6 full blocks, 6 cacheable (the last token is always computed)
    cycle = Cycle(r, [], HashRing(), RecentCounts())
    assert s.score(cycle, Candidate("a")) == 100
    assert s.score(cycle, Candidate("a", matched_blocks=2)) == 100 - 32
    assert s.score(cycle, Candidate("a", matched_blocks=99)) == 100 - cycle.limit * 16 > 0
