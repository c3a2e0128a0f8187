from __future__ import annotations

import collections

from router.schedule import Candidate, HashRing, build_named
from tests.schedule.common import req


def test_least_loaded_takes_the_minimum_and_spreads_ties():
    p = build_named("least_loaded", HashRing(), {"seed": 1})
    cands = [Candidate("a", inflight=3), Candidate("b", inflight=1), Candidate("c", inflight=1)]
    picks = collections.Counter(p.choose(req(16), cands).replica for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 50


def test_a_seed_repeats_the_draws():
    def draws() -> list[str]:
        p = build_named("least_loaded", HashRing(), {"seed": 5})
        return [p.choose(req(16), [Candidate(u) for u in "abcd"]).replica for _ in range(30)]

    assert draws() == draws()
