"""ring_spill on small constructed fleets: stay on holders under the cap, spill along the
prefix's ring only when it saves more than the cap, spread cold prefixes by queue, then by
recent work."""

from __future__ import annotations

from router.schedule import Candidate, HashRing, build_named
from router.schedule.keys import routing_key
from tests.schedule.common import req

URLS = ["a", "b", "c", "d"]
CAP = 1536


def _policy():
    return build_named("ring_spill", HashRing(URLS), {"queue_cap_tokens": CAP})


def _ring(r) -> list[str]:
    return list(HashRing(URLS).walk(routing_key(r)))


def test_cold_prefix_goes_to_the_shortest_queue_not_the_ring_owner():
    r = req(640, first=3)
    owner, second, *_ = _ring(r)
    cands = [Candidate(u, pending_prefill_tokens=0 if u == second else 500) for u in URLS]
    d = _policy().choose(r, cands)
    assert (d.replica, d.reason, d.ring_choice) == (second, "ring", owner)


def _recent(policy, **placed: tuple[int, int]):
    """``policy`` placed ``n`` requests of ``work`` uncached tokens each on ``u`` just now
    (``u=(n, work)``; a frozen clock)."""
    policy.recent.clock = lambda: 0.0
    for u, (n, work) in placed.items():
        for _ in range(n):
            policy.recent.add(u, work)
    return policy


def test_cold_prefix_on_tied_queues_goes_to_the_least_recent_work_not_the_ring_owner():
    """Queues tie (an idle fleet): the replica that took clearly less prefill work lately
    takes the new prefix, even with a request in flight, so a tenant's first, uncached
    prefill lands beside the fewest other tenants' requests."""
    r = req(640, first=3)
    owner, second, third, fourth = _ring(r)
    cands = [Candidate(u) for u in URLS]
    policy = _recent(
        _policy(), **{owner: (8, 1000), second: (8, 1000), third: (5, 800), fourth: (6, 1000)}
    )
    d = policy.choose(r, cands)
    assert (d.replica, d.reason, d.ring_choice) == (third, "ring", owner)
    assert "recent work 4000 tokens (least 4000), 0 in flight, ring position 2" in d.why
    # Before the requests in flight (before: the fewest in flight, then ring order: the owner).
    busy = [Candidate(u, inflight=1 if u == third else 0) for u in URLS]
    assert policy.choose(r, busy).replica == third
    # A shorter queue still comes first.
    queued = [Candidate(u, pending_prefill_tokens=0 if u == second else 100) for u in URLS]
    assert policy.choose(r, queued).replica == second


def test_cold_prefix_on_an_idle_or_evenly_loaded_fleet_goes_by_in_flight_then_ring_order():
    """Recent work is compared coarsely (at most 1.25x the least, or at most 4 requests
    lately): an idle fleet, a few requests, or replicas that took about the same work fall to
    the fewest in flight, then ring order, where every gateway agrees."""
    r = req(640, first=3)
    owner, second, third, fourth = _ring(r)
    cands = [Candidate(u) for u in URLS]
    assert _policy().choose(r, cands).replica == owner
    few = _recent(_policy(), **{owner: (4, 2000), second: (1, 100)})
    assert few.choose(r, cands).replica == owner  # 4 requests: not yet traffic
    even = {owner: (10, 1000), second: (9, 1000), third: (8, 1000), fourth: (10, 1000)}
    assert _recent(_policy(), **even).choose(r, cands).replica == owner  # 10k <= 1.25 x 8k
    uneven = {**even, owner: (11, 1000)}
    assert _recent(_policy(), **uneven).choose(r, cands).replica == second  # 11k > 10k
    near = {owner: (8, 1000), second: (7, 1000), third: (20, 1000), fourth: (20, 1000)}
    busy = [Candidate(u, inflight=1 if u == owner else 0) for u in URLS]
    assert _recent(_policy(), **near).choose(r, busy).replica == second  # then in flight


def test_holder_under_the_cap_keeps_the_prefix_even_when_another_is_idle():
    r = req(640, first=3)
    holder = _ring(r)[2]
    cands = [
        Candidate(u, matched_blocks=40 if u == holder else 0, pending_prefill_tokens=0)
        for u in URLS
    ]
    cands = [
        Candidate(c.url, c.matched_blocks, pending_prefill_tokens=CAP if c.url == holder else 0)
        for c in cands
    ]
    d = _policy().choose(r, cands)
    assert (d.replica, d.reason) == (holder, "prefix")
    assert "ring position 2" in d.why


def test_first_holder_in_ring_order_wins_among_equal_holders():
    r = req(640, first=3)
    ring = _ring(r)
    holders = {ring[1], ring[3]}
    cands = [Candidate(u, matched_blocks=40 if u in holders else 0) for u in URLS]
    assert _policy().choose(r, cands).replica == ring[1]


def test_over_the_cap_spills_to_the_next_on_the_ring_not_the_cheapest():
    r = req(640, first=3)
    ring = _ring(r)
    # The owner holds everything but queues 5,000 tokens; ring[1] queues a little, ring[3]
    # nothing: a cost-minimiser would take ring[3], ring_spill takes ring[1] (its copy is the
    # one the next spills of this prefix will find).
    queue = {ring[0]: 5000, ring[1]: 100, ring[2]: 2000, ring[3]: 0}
    cands = [
        Candidate(u, matched_blocks=40 if u == ring[0] else 0, pending_prefill_tokens=queue[u])
        for u in URLS
    ]
    d = _policy().choose(r, cands)
    assert (d.replica, d.reason) == (ring[1], "spill")
    assert "next on the prefix's ring, position 1" in d.why
    assert "held by 1 at ring positions 0" in d.why
    assert build_named("ttft", HashRing(URLS)).choose(r, cands).replica == ring[3]
    # The copy is made: the next request finds two holders and, under the cap, takes the
    # first on the ring that is.
    cands[URLS.index(ring[1])] = Candidate(  # cands are in URL order
        ring[1], matched_blocks=40, pending_prefill_tokens=740
    )
    d = _policy().choose(r, cands)
    assert (d.replica, d.reason) == (ring[1], "prefix")
    assert "held by 2 at ring positions 0,1" in d.why


def test_over_the_cap_stays_when_no_spill_saves_more_than_the_cap():
    r = req(640, first=3)
    ring = _ring(r)
    # 2,000 queued on the holder; a non-holder would prefill 640 tokens: it saves 1,360 < cap.
    cands = [
        Candidate(
            u,
            matched_blocks=39 if u == ring[0] else 0,
            pending_prefill_tokens=2000 if u == ring[0] else 0,
        )
        for u in URLS
    ]
    d = _policy().choose(r, cands)
    assert (d.replica, d.reason) == (ring[0], "prefix")
    assert "no spill saves more" in d.why


def _slow_policy(ttft_cap_s: float = 3.0):
    return build_named(
        "ring_spill", HashRing(URLS), {"queue_cap_tokens": CAP, "ttft_cap_s": ttft_cap_s}
    )


def _stuck_owner(r, owner_ttft_s: float, **extra_ttft: float) -> list[Candidate]:
    """The owner holds the whole prompt with a queue over the cap that no spill beats on
    tokens (the case above); its observed time to first byte is ``owner_ttft_s``."""
    ring = _ring(r)
    ttft = {ring[0]: owner_ttft_s, **{ring[int(k[1:])]: v for k, v in extra_ttft.items()}}
    return [
        Candidate(
            u,
            matched_blocks=39 if u == ring[0] else 0,
            pending_prefill_tokens=2000 if u == ring[0] else 0,
            ttft_s=ttft.get(u, 0.0),
        )
        for u in URLS
    ]


def test_a_holder_observed_slower_than_the_ttft_cap_sheds_to_the_next_on_the_ring():
    r = req(640, first=3)
    ring = _ring(r)
    # The tokens say stay (as above), but its first bytes take 5 s: decode load or another
    # gateway's queue the token counts do not show. The next on the ring takes it.
    d = _slow_policy().choose(r, _stuck_owner(r, 5.0))
    assert (d.replica, d.reason, d.cause) == (ring[1], "spill", "observed_ttft")
    assert "observed time to first byte 5.00 s is over 3 s" in d.why
    assert d.copied_blocks == 39 and d.holders == 1
    # ... skipping a next one that is slow too.
    d = _slow_policy().choose(r, _stuck_owner(r, 5.0, p1=4.0))
    assert d.replica == ring[2]
    # Under the cap, or with the cap off, it stays.
    for policy, ttft in ((_slow_policy(), 2.9), (_slow_policy(0.0), 50.0)):
        d = policy.choose(r, _stuck_owner(r, ttft))
        assert (d.replica, d.reason, d.cause) == (ring[0], "prefix", None)


def test_a_slow_holder_under_the_queue_cap_yields_to_the_next_holder():
    r = req(640, first=3)
    ring = _ring(r)
    cands = [
        Candidate(u, matched_blocks=40 if u in ring[:2] else 0, ttft_s=4.0 if u == ring[0] else 0)
        for u in URLS
    ]
    d = _slow_policy().choose(r, cands)
    assert (d.replica, d.reason) == (ring[1], "prefix")
    assert "held by 2 at ring positions 0,1" in d.why


def test_every_replica_slow_is_the_token_rule_again():
    r = req(640, first=3)
    ring = _ring(r)
    slow = {f"p{i}": 9.0 for i in range(1, 4)}
    d = _slow_policy().choose(r, _stuck_owner(r, 9.0, **slow))
    assert (d.replica, d.reason) == (ring[0], "prefix")
    assert "no spill saves more" in d.why


def test_the_policy_bounds_requests_in_flight_at_2_5x_the_mean():
    r = req(640, first=3)
    ring = _ring(r)
    # A short-prompt burst: the holder's token queue stays under the cap, but it has every
    # request in flight. At 7 (8 > ceil(2.5 x 8 / 4) + 2 = 7) it yields to the next on the
    # ring; at 6 (7 <= 7) it keeps the prefix.
    for inflight, where in ((7, ring[1]), (6, ring[0])):
        cands = [
            Candidate(
                u, matched_blocks=40 if u == ring[0] else 0, inflight=inflight * (u == ring[0])
            )
            for u in URLS
        ]
        d = build_named("ring_spill", HashRing(URLS)).choose(r, cands)
        assert d.replica == where, inflight
    assert d.filtered == {}
    off = build_named("ring_spill", HashRing(URLS), {"inflight_bound": 0})
    cands[URLS.index(ring[0])] = Candidate(ring[0], matched_blocks=40, inflight=50)
    assert off.choose(r, cands).replica == ring[0]


def _spill_case(r):
    """The owner holds ``r``'s prefix with 5,000 tokens queued; ring[1] is idle."""
    ring = _ring(r)
    queue = {ring[0]: 5000, ring[1]: 0, ring[2]: 2000, ring[3]: 2000}
    cands = [
        Candidate(u, matched_blocks=40 if u == ring[0] else 0, pending_prefill_tokens=queue[u])
        for u in URLS
    ]
    return ring, cands


def test_a_cold_prefix_over_the_cap_stays_on_its_holder_once_others_dominate_traffic():
    cold, hot = req(640, first=3), req(640, first=4)
    ring, cands = _spill_case(cold)
    p = _policy()
    assert p.choose(cold, cands).replica == ring[1]  # no history: free to spill
    for _ in range(40):  # another prefix's traffic: cold's share is 1 / 41 -> 1 replica
        p.placed(p.choose(hot, [Candidate(u) for u in URLS]))
    d = p.choose(cold, cands)
    assert (d.replica, d.reason) == (ring[0], "prefix")
    assert set(d.filtered) == set(URLS) - {ring[0]}
    assert set(d.filtered.values()) == {"replica_set_bound"}
    off = build_named(
        "ring_spill", HashRing(URLS), {"queue_cap_tokens": CAP, "replica_set_factor": 0}
    )
    assert off.choose(cold, cands).replica == ring[1]  # without the bound it spills


def test_a_hot_prefix_still_spills_within_its_share():
    hot = req(640, first=3)
    ring, cands = _spill_case(hot)
    p = _policy()
    for _ in range(40):  # all the traffic is this prefix's: 1.5 x 1 x 4 -> every replica
        p.placed(p.choose(hot, [Candidate(u) for u in URLS]))
    d = p.choose(hot, cands)
    assert (d.replica, d.reason, d.cause) == (ring[1], "spill", "queue_cap")
