from __future__ import annotations

from router.schedule import Candidate, HashRing, PluginSpec, ProfileSpec, build
from router.schedule.keys import routing_key
from tests.schedule.common import req

URLS = ["a", "b", "c", "d"]


def _policy() -> object:
    spec = ProfileSpec((), (PluginSpec("uncached_prefill"),), PluginSpec("ring_min_cost"))
    return build(spec, HashRing(URLS))


def test_cold_prompts_go_to_the_ring_owner_with_the_pickers_reason():
    p = _policy()
    r = req(64, first=11)
    d = p.choose(r, [Candidate(u) for u in URLS])
    assert d.reason == "ring" and d.replica == d.ring_choice
    assert d.replica == next(HashRing(URLS).walk(routing_key(r)))
    assert "ring owner" in d.why


def test_least_cost_wins_and_equal_costs_break_by_ring_rank_not_url():
    p = _policy()
    d = p.choose(req(160), [Candidate("a", matched_blocks=2), Candidate("d", matched_blocks=5)])
    assert d.replica == "d" and d.reason == "prefix"
    owners = {
        p.choose(req(64, first=i), [Candidate(u, matched_blocks=3) for u in URLS]).replica
        for i in range(60)
    }
    assert len(owners) > 1  # URL order would always say "a"
