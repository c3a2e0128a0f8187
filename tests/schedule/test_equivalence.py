"""The plugin pipeline decides exactly as the monolithic policies did (the frozen copy in
``legacy_policies``), decision after decision, with the stateful parts (recent-share history,
round-robin counter, seeded draws) evolving side by side."""

from __future__ import annotations

import random

import pytest

from router.schedule import HashRing, build_named
from tests.schedule import legacy_policies as legacy
from tests.schedule.common import essence, random_fleet, random_request

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]


def _legacy_essence(d: legacy.Decision) -> tuple:
    return (
        d.replica,
        d.reason,
        d.matched_blocks,
        d.ring_choice,
        tuple((s.url, s.filtered, s.cost) for s in d.scores),
    )


def _run(old, new, *, index: bool, n: int = 1500, seed: int = 0) -> int:
    """Drive both through the same decisions; return how many were spills or bound-limited
    (so a test can insist the interesting paths were exercised)."""
    rng = random.Random(seed)
    clock = [0.0]
    for p in (old, new):
        if hasattr(p, "recent"):
            p.recent.clock = lambda: clock[0]
    interesting = 0
    for _ in range(n):
        clock[0] += rng.choice([0.001, 0.01, 0.05, 0.5])
        r = random_request(rng)
        urls = rng.sample(URLS, rng.randint(1, len(URLS)))  # members come and go
        cands = random_fleet(rng, r, urls, index=index)
        a, b = old.choose(r, cands), new.choose(r, cands)
        got = essence(b) if a.scores else essence(b)[:4]
        assert got == _legacy_essence(a)[: len(got)]
        old.placed(a)
        new.placed(b)
        interesting += a.reason == "spill" or any(s.filtered for s in a.scores)
    return interesting


def test_ttft_decides_as_before_with_its_history():
    ring, ring_old = HashRing(URLS), HashRing(URLS)
    interesting = _run(legacy.TTFTPolicy(ring_old), build_named("ttft", ring), index=True)
    assert interesting > 100  # spills and both bounds were exercised, not only cold rings


@pytest.mark.parametrize("c,decode", [(1.0, 0.0), (1.5, 3.0), (2.0, 16.0)])
def test_ttft_knobs_decide_as_before(c, decode):
    old = legacy.TTFTPolicy(HashRing(URLS), c, decode)
    new = build_named("ttft", HashRing(URLS), knobs={"load_bound": c, "decode_cost_tokens": decode})
    _run(old, new, index=True, n=600, seed=int(c * 10 + decode))


def test_consistent_hash_decides_as_before():
    old = legacy.ConsistentHashPolicy(HashRing(URLS), 1.25)
    _run(old, build_named("consistent_hash", HashRing(URLS)), index=False)


def test_round_robin_decides_as_before():
    _run(legacy.RoundRobinPolicy(), build_named("round_robin", HashRing(URLS)), index=False)


@pytest.mark.parametrize(
    "name,cls", [("random", "RandomPolicy"), ("least_loaded", "LeastLoadedPolicy")]
)
def test_seeded_baselines_draw_as_before(name, cls):
    old = getattr(legacy, cls)(seed=7)
    _run(old, build_named(name, HashRing(URLS), {"seed": 7}), index=False)
