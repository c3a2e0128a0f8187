from __future__ import annotations

from router.schedule import Candidate, HashRing, PluginSpec, registry
from router.schedule.recent import RecentCounts
from router.schedule.types import Cycle
from tests.schedule.common import req


def _removed(c: float, loads: list[int]) -> set[str]:
    f = registry.plugin("filter", PluginSpec("load_bound", {"load_bound": c}))
    cands = [Candidate(f"r{i}", inflight=n) for i, n in enumerate(loads)]
    return f.remove(Cycle(req(64), cands, HashRing(), RecentCounts()))


def test_removes_only_replicas_past_c_times_the_mean_plus_slack():
    # mean after one more = 16/4 = 4; ceil(1.25 x 4) + 2 = 7: 7 in flight + 1 is over
    assert _removed(1.25, [7, 6, 1, 1]) == {"r0"}
    assert _removed(1.25, [6, 6, 1, 2]) == set()


def test_a_looser_bound_keeps_more():
    assert _removed(1.0, [9, 1, 1, 1]) == {"r0"}
    assert _removed(3.0, [9, 1, 1, 1]) == set()
