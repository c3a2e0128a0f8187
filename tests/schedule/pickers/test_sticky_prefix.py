"""sticky_prefix: always the longest holder, whatever its queue; cold to the least loaded."""

from __future__ import annotations

from router.schedule import Candidate, HashRing, build_named
from tests.schedule.common import req

URLS = ["a", "b", "c", "d"]


def test_longest_holder_wins_however_busy():
    p = build_named("sticky_prefix", HashRing(URLS))
    cands = [
        Candidate("a", matched_blocks=10, inflight=50, pending_prefill_tokens=90_000),
        Candidate("b", matched_blocks=9),
        Candidate("c"),
        Candidate("d"),
    ]
    d = p.choose(req(320), cands)
    assert (d.replica, d.reason) == ("a", "prefix")


def test_cold_prefix_goes_to_the_least_loaded():
    p = build_named("sticky_prefix", HashRing(URLS))
    cands = [Candidate(u, inflight=0 if u == "c" else 3) for u in URLS]
    d = p.choose(req(320), cands)
    assert (d.replica, d.reason) == ("c", "ring")
