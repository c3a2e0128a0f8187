from __future__ import annotations

from router.schedule import Candidate, HashRing, build_named
from router.schedule.keys import routing_key
from tests.schedule.common import req

URLS = ["a", "b", "c"]


def test_the_owner_unless_it_is_over_the_bound_and_the_cache_never_counts():
    p = build_named("consistent_hash", HashRing(URLS))
    r = req(64, first=5)
    order = list(HashRing(URLS).walk(routing_key(r)))
    d = p.choose(r, [Candidate(u, matched_blocks=4 if u != order[0] else 0) for u in URLS])
    assert d.replica == order[0] == d.ring_choice and not p.uses_index
    busy = [Candidate(u, inflight=20 if u == order[0] else 0) for u in URLS]
    assert p.choose(r, busy).replica == order[1]
