from __future__ import annotations

from router.schedule import Candidate, HashRing, build_named
from tests.schedule.common import req


def test_takes_each_replica_in_url_order_whatever_the_candidate_order():
    p = build_named("round_robin", HashRing())
    picks = [p.choose(req(16), [Candidate(u) for u in "cab"]).replica for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert p.choose(req(16), [Candidate("a")]).reason == "round_robin"  # the policy's name
