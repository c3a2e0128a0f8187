"""replica_set_bound on small constructed fleets: a prefix's replica set is bounded by its
share of the requests placed lately, so a cold prefix stays on its holder and a hot one may
spread only as far as its traffic says."""

from __future__ import annotations

from router.schedule import Candidate, HashRing, PluginSpec, build_named, registry
from router.schedule.recent import PrefixRates, RecentCounts
from router.schedule.types import Cycle, Decision
from tests.schedule.common import req

URLS = [f"r{i}" for i in range(8)]
HOT, COLD = req(640, first=1), req(640, first=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _filter(**params):
    return registry.plugin("filter", PluginSpec("replica_set_bound", params))


def _place(f, r, n: int, clock: Clock) -> None:
    """``n`` requests of ``r``'s prefix placed (the pipeline's hook), at ``clock``'s time."""
    key = build_named("round_robin", HashRing(URLS)).choose(r, [Candidate(u) for u in URLS])
    for _ in range(n):
        f.placed(Decision("r0", 0, "x", "p", prefix_key=key.prefix_key), clock())


def _removed(f, r, holders: int, clock: Clock) -> set[str]:
    cands = [Candidate(u, matched_blocks=40 if i < holders else 0) for i, u in enumerate(URLS)]
    return f.remove(Cycle(r, cands, HashRing(URLS), RecentCounts(clock=clock)))


def test_a_prefix_with_a_small_share_keeps_to_its_one_holder():
    clock = Clock()
    f = _filter()  # factor 1
    _place(f, HOT, 20, clock)
    _place(f, COLD, 2, clock)
    # COLD's share (2 + 1) / 23 -> 1 x 0.13 x 8 = 1.04 -> 2 allowed, it has 1: free to spill
    assert _removed(f, COLD, 1, clock) == set()
    _place(f, HOT, 60, clock)
    # now (2 + 1) / 83 -> 0.29 -> 1 allowed: everyone but the holder is removed
    assert _removed(f, COLD, 1, clock) == set(URLS[1:])
    assert _removed(f, COLD, 0, clock) == set()  # nobody holds it: anywhere


def test_a_hot_prefix_grows_to_its_share_then_stops():
    clock = Clock()
    f = _filter(factor=1.5)
    _place(f, HOT, 30, clock)
    _place(f, COLD, 60, clock)
    # HOT's share 31 / 91 -> 1.5 x 0.34 x 8 = 4.09 -> 5 replicas
    for holders in range(1, 5):
        assert _removed(f, HOT, holders, clock) == set(), holders
    assert _removed(f, HOT, 5, clock) == set(URLS[5:])
    assert _removed(f, HOT, 6, clock) == set(URLS[6:])
    # the default factor 1 bounds it sooner: 1 x 0.34 x 8 = 2.7 -> 3
    g = _filter()
    _place(g, HOT, 30, clock)
    _place(g, COLD, 60, clock)
    assert _removed(g, HOT, 2, clock) == set()
    assert _removed(g, HOT, 3, clock) == set(URLS[3:])


def test_the_set_shrinks_as_the_prefix_cools():
    clock = Clock()
    f = _filter(half_life_s=10.0)
    _place(f, HOT, 60, clock)
    _place(f, COLD, 30, clock)
    assert _removed(f, HOT, 5, clock) == set()  # 61 / 91 -> 5.4 -> 6 allowed
    assert _removed(f, HOT, 6, clock) == set(URLS[6:])
    clock.now = 30.0  # HOT stops; COLD keeps sending
    _place(f, COLD, 60, clock)
    # HOT decayed to 7.5, total 71.25: 8.5 / 72.25 x 8 = 0.94 -> 1 allowed
    assert _removed(f, HOT, 1, clock) == set(URLS[1:])


def test_the_pipeline_counts_placements_not_explains():
    clock = Clock()
    p = build_named("ring_spill", HashRing(URLS))
    p.recent = RecentCounts(clock=clock)
    (f,) = [x for x in p.filters if x.name == "replica_set_bound"]
    cands = [Candidate(u) for u in URLS]
    d = p.choose(HOT, cands)  # as explain does: decided, not placed
    assert f.rates.total(clock()) == 0
    p.placed(d)
    assert f.rates.count(d.prefix_key, clock()) == 1.0
    assert f.rates.total(clock()) == 1.0


def test_one_off_prefixes_are_forgotten():
    rates = PrefixRates(half_life_s=1.0)
    for i in range(PrefixRates.SWEEP - 1):
        rates.add(i, 0.0)
    assert len(rates) == PrefixRates.SWEEP - 1
    rates.add(-1, 60.0)  # a minute of half-lives later: the sweep drops the decayed ones
    assert len(rates) == 1
    assert rates.count(-1, 60.0) == 1.0
