"""The fair queue's dispatch order on small constructed cases (no clock, no I/O)."""

from __future__ import annotations

from router.flow.fairqueue import Entry, FairQueue


def push(
    q: FairQueue[str],
    name: str,
    tenant: str,
    *,
    cost: float = 100,
    weight: float = 1,
    band: str = "standard",
    session: str = "",
) -> Entry[str]:
    return q.push(Entry(name, tenant, session, band, cost, weight, 0.0))


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.item)
    return out


def test_weights_share_the_releases():
    q: FairQueue[str] = FairQueue()
    for i in range(6):
        push(q, f"a{i}", "a", weight=3)
    for i in range(6):
        push(q, f"b{i}", "b", weight=1)
    order = drain(q)
    # a goes three times for each of b's turns while both wait (a tie goes to the flow
    # that has waited longer: b at virtual time 1)
    assert [x[0] for x in order[:8]] == list("abaabaaa")
    assert sorted(order) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])
    # each tenant's own requests keep their order
    assert [x for x in order if x[0] == "a"] == [f"a{i}" for i in range(6)]


def test_cost_not_count_is_shared():
    # a's requests cost 10x b's: b gets ten releases for each of a's
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        push(q, f"a{i}", "a", cost=1000)
    for i in range(25):
        push(q, f"b{i}", "b", cost=100)
    order = drain(q)
    assert order.index("a1") == 11 and order.index("a2") == 22


def test_bands_are_strict_priority():
    q: FairQueue[str] = FairQueue()
    push(q, "s", "x", band="sheddable")
    push(q, "n", "y", band="standard")
    push(q, "c", "z", band="critical", cost=10**6)
    push(q, "n2", "y", band="standard")
    assert drain(q) == ["c", "n", "n2", "s"]


def test_a_session_cannot_starve_its_tenants_others():
    q: FairQueue[str] = FairQueue()
    for i in range(10):
        push(q, f"long{i}", "t", session="agent-1")
    push(q, "other", "t", session="agent-2")
    order = drain(q)
    assert order.index("other") == 1


def test_remove_takes_one_out_and_keeps_the_rest_in_order():
    q: FairQueue[str] = FairQueue()
    a0 = push(q, "a0", "a")
    push(q, "a1", "a")
    b0 = push(q, "b0", "b")
    push(q, "b1", "b")
    assert q.remove(b0) and not q.remove(b0)
    assert q.remove(a0)
    assert q.size == 2 and q.tenant_depth("standard", "a") == 1
    assert drain(q) == ["a1", "b1"]
    assert q.size == 0 and q.depth("standard") == 0


def test_history_counts_and_is_bounded():
    # b was charged work dispatched around the queue: a goes first despite queueing later
    q: FairQueue[str] = FairQueue(max_lead=250)
    q.charge("standard", "b", 10_000, 1, dispatched=False)
    assert q.lag("standard", "b") == 250  # bounded by max_lead
    push(q, "b0", "b")
    push(q, "a0", "a")
    push(q, "a1", "a")
    push(q, "a2", "a")
    push(q, "a3", "a")
    order = drain(q)
    # b waits until a has done the 250 its lead is worth (100 per request), no longer
    assert order == ["a0", "a1", "a2", "b0", "a3"]


def test_newest_of_a_band_is_what_overflow_sheds():
    q: FairQueue[str] = FairQueue()
    push(q, "s0", "x", band="sheddable")
    push(q, "s1", "y", band="sheddable")
    push(q, "n0", "z")
    newest = q.newest("sheddable")
    assert newest is not None and newest.item == "s1"
    assert q.newest("critical") is None


def test_idle_tenants_are_bounded():
    q: FairQueue[str] = FairQueue(max_idle=10)
    for t in range(100):
        push(q, f"r{t}", f"t{t}")
    drain(q)
    assert len(q.bands["standard"].tenants) <= 10
    # a newcomer is not held back by anyone's past
    push(q, "old", "t99")
    push(q, "new", "new")
    assert drain(q) == ["new", "old"]


def test_a_tenant_that_cannot_go_now_keeps_its_place():
    # a's next request waits for a replica that is busy: b goes, a is still first after
    q: FairQueue[str] = FairQueue()
    push(q, "a0", "a")
    push(q, "b0", "b")
    push(q, "b1", "b")
    busy = {"a0"}
    first = q.pop(lambda e: e.item not in busy)
    assert first is not None and first.item == "b0"
    busy.clear()
    assert drain(q) == ["a0", "b1"]
    # nothing eligible: nothing leaves
    push(q, "c0", "c")
    assert q.pop(lambda e: False) is None and q.size == 1


def test_a_lower_band_goes_only_when_no_higher_entry_can():
    q: FairQueue[str] = FairQueue()
    push(q, "crit", "x", band="critical")
    push(q, "low", "y", band="sheddable")
    first = q.pop(lambda e: e.item != "crit")
    assert first is not None and first.item == "low"
    assert drain(q) == ["crit"]


def busy_band(q: FairQueue[str], light: dict[str, int], busy: int) -> None:
    """``light`` tenants did so many requests of cost 100 each, then ``busy`` did ``busy``
    (all dispatched, nothing queued): the band's virtual time is busy's last start."""
    for tenant, n in light.items():
        for _ in range(n):
            q.charge("standard", tenant, 100, 1, dispatched=True)
    for i in range(busy):
        push(q, f"old{i}", "busy")
    drain(q)


def test_an_under_share_tenant_spends_its_credit_first_and_no_more():
    q: FairQueue[str] = FairQueue(burst=250)
    busy_band(q, {"light": 1}, busy=10)  # busy's last start: 900; light's finish: 100
    for i in range(4):
        push(q, f"busy{i}", "busy")
    for i in range(5):
        push(q, f"light{i}", "light")
    # light starts 250 behind the band (650), not at its finish (100): its tags 650, 750,
    # 850, 950 come before busy's next (1000), then the two alternate
    assert drain(q) == [
        "light0",
        "light1",
        "light2",
        "light3",
        "busy0",
        "light4",
        "busy1",
        "busy2",
        "busy3",
    ]


def test_a_tenant_never_seen_has_no_credit():
    q: FairQueue[str] = FairQueue(burst=1000)
    busy_band(q, {}, busy=5)
    push(q, "busy5", "busy")
    push(q, "new0", "new")
    push(q, "new1", "new")
    # new starts at the band's virtual time (400), busy's next at 500: new, then they alternate
    assert drain(q) == ["new0", "busy5", "new1"]


def test_under_share_tenants_go_first_come_first_served_among_themselves():
    q: FairQueue[str] = FairQueue(burst=1000)
    busy_band(q, {"x": 3, "y": 1}, busy=10)  # x's finish 300, y's 100: both under 900
    push(q, "busy10", "busy")
    push(q, "x0", "x")
    push(q, "y0", "y")
    push(q, "x1", "x")
    # by tags y0 (100) would go before x0 (300); first come, first served instead
    assert drain(q) == ["x0", "y0", "x1", "busy10"]


def test_without_credit_it_is_plain_start_time_fair_queuing():
    q: FairQueue[str] = FairQueue()
    busy_band(q, {"light": 1}, busy=10)
    push(q, "busy10", "busy")
    push(q, "light0", "light")
    push(q, "light1", "light")
    assert drain(q) == ["light0", "busy10", "light1"]


def test_first_come_first_served_below_the_busiest_even_ahead_of_the_virtual_time():
    # a flood has just begun with one costly request: the band's virtual time is still
    # where the quiet tenants are, but both are far below the flood's next tag
    q: FairQueue[str] = FairQueue(burst=1000)
    q.charge("standard", "x", 100, 1, dispatched=True)  # x's finish 100
    q.charge("standard", "y", 100, 1, dispatched=True)
    q.charge("standard", "y", 100, 1, dispatched=True)  # y's finish 200; virtual time 100
    push(q, "flood0", "flood", cost=1000)
    assert drain(q) == ["flood0"]  # flood's next tag: 1100
    push(q, "flood1", "flood")
    push(q, "y0", "y")  # tag 200
    push(q, "x0", "x")  # tag 100
    assert drain(q) == ["y0", "x0", "flood1"]


def test_a_sessions_past_does_not_hold_it_behind_its_tenants_others():
    """u0 carried the tenant's first, uncached request (its system prompt); once u0 has
    nothing queued that is forgotten: its next request, the first to arrive, goes first
    (charged by cost and remembered, u0 went after every later request of u1 and u2)."""
    for burst in (0.0, 4096.0):
        q: FairQueue[str] = FairQueue(burst=burst)
        push(q, "first", "t", cost=1168, session="u0")
        assert drain(q) == ["first"]
        push(q, "u0-next", "t", cost=144, session="u0")
        push(q, "u1", "t", cost=144, session="u1")
        push(q, "u2", "t", cost=144, session="u2")
        assert drain(q) == ["u0-next", "u1", "u2"]


def test_a_tenants_sessions_take_turns_by_request():
    q: FairQueue[str] = FairQueue(burst=4096.0)
    push(q, "big", "t", cost=1168, session="u0")
    push(q, "u0-small", "t", cost=144, session="u0")
    for i in range(3):
        push(q, f"u1-{i}", "t", cost=144, session="u1")
    # by cost, u1 went three times before u0's second request
    assert drain(q) == ["big", "u1-0", "u0-small", "u1-1", "u1-2"]


def test_a_session_with_a_request_waiting_is_not_overtaken_by_sessions_coming_back():
    """u0's second request waits behind its first; u1-u3 each send one request at a time.
    Their next requests come after u0's second (it waited longer; turns by request): with
    their pasts forgotten, they started a turn before it and overtook it again and again."""
    for burst in (0.0, 4096.0):
        q: FairQueue[str] = FairQueue(burst=burst)
        push(q, "u0-0", "t", session="u0")
        for u in ("u1", "u2", "u3"):
            push(q, f"{u}-0", "t", session=u)
        push(q, "u0-1", "t", session="u0")
        out = [e.item for e in (q.pop(), q.pop(), q.pop(), q.pop()) if e is not None]
        for u in ("u1", "u2", "u3"):
            push(q, f"{u}-1", "t", session=u)
        assert out + drain(q) == ["u0-0", "u1-0", "u2-0", "u3-0", "u0-1", "u1-1", "u2-1", "u3-1"]
