from __future__ import annotations

from router.schedule import Candidate, HashRing, PluginSpec, registry
from router.schedule.recent import RecentCounts
from router.schedule.types import Cycle
from tests.schedule.common import req


def _removed(history: dict[str, int], **params) -> set[str]:
    f = registry.plugin("filter", PluginSpec("recent_share", params))
    recent = RecentCounts(clock=lambda: 0.0)  # no decay: the counts are exact
    for url, n in history.items():
        for _ in range(n):
            recent.add(url)
    cands = [Candidate(u) for u in history]
    return f.remove(Cycle(req(64), cands, HashRing(), recent))


def test_light_history_removes_nobody_however_skewed():
    assert _removed({"a": 60, "b": 0, "c": 0, "d": 3}) == set()  # 63 < 16 x 4


def test_sustained_history_caps_each_share():
    # total 80 over 4: bound = 1.25 x 81 / 4 + 1 = 26.3; a has 40 (+1 over), b 25 (+1 within)
    assert _removed({"a": 40, "b": 25, "c": 10, "d": 5}) == {"a"}


def test_min_recent_is_a_parameter():
    assert _removed({"a": 40, "b": 25, "c": 10, "d": 5}, min_recent=32) == set()
