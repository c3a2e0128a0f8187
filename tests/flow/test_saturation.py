"""Where a request may take a prefill slot, and when the gate is a tenant's alone (pure: no
sockets)."""

from __future__ import annotations

from router.flow.reservations import Contention
from router.flow.saturation import Capacity, Thresholds, Waiting, capacity


def cap(**free: float) -> Capacity:
    return Capacity(dict(free), 0.0, float(len(free)), 0.0, {})


def test_an_unheld_prefix_leaves_a_replica_to_the_requests_queued_before_it() -> None:
    c = cap(a=1, b=0, c=1)
    # queue order 1: waits for a; 5: waits for c (or b); 7: waits for a
    waiting = Waiting.of([(1, ("a",)), (5, ("b", "c")), (7, ("a",)), (8, ("gone",))], c)
    assert waiting.oldest == {"a": 1, "b": 5, "c": 5}
    assert waiting.count == {"a": 2, "b": 1, "c": 1}
    assert c.best_unheld(waiting, 3) == "c"  # a is someone's earlier; c is not
    assert c.best_unheld(waiting, 0) == "c"  # both free to it: fewer wait for c
    assert c.best_unheld(waiting, 6) is None  # a and c both have earlier waiters
    assert c.best_unheld(Waiting({}, {}), 6) == "a"  # nobody waits: the most free, then name


def test_among_equally_free_replicas_the_scheduler_places_an_unheld_prefix() -> None:
    """The slot is where the scheduler would send the request (its picker's rule for a
    prefix nobody holds), asked only about the replicas that tie here."""
    c = cap(a=1, b=1, c=1, d=0.5)
    asked: list[list[str]] = []

    def place(urls: list[str]) -> str:
        asked.append(urls)
        return urls[-1]

    nobody = Waiting({}, {})
    assert c.best_unheld(nobody, 0, place) == "c"
    assert asked == [["a", "b", "c"]]  # d has less free: not among them
    waiting = Waiting.of([(1, ("a",))], c)
    assert c.best_unheld(waiting, 0, place) == "c"  # fewer wait for b and c than for a
    assert asked[-1] == ["b", "c"]
    asked.clear()
    assert cap(a=1, b=0).best_unheld(nobody, 0, place) == "a"  # one left: nothing to ask
    assert asked == []


class _Stats:
    waiting, kv_usage = 0, 0.0


class _Replica:
    stats, ttft = _Stats(), None

    def __init__(self, url: str, remote_prefill_tokens: int = 0) -> None:
        self.url, self.remote_prefill_tokens = url, remote_prefill_tokens


def test_a_tenant_alone_fills_a_replica_to_vllms_step_not_to_one_request() -> None:
    t = Thresholds(prefill_per_replica=1.0, step_tokens=2048)
    replicas = [_Replica("a"), _Replica("b")]
    count, tokens = {"a": 3}, {"a": 900}
    fair = capacity(replicas, count, t, 1024.0)
    assert fair.free_by_replica["a"] == -2  # contended: one request each
    alone = capacity(replicas, count, t, 1024.0, alone=True, reserved_tokens=tokens)
    assert alone.free_by_replica["a"] > 0  # 900 of 2048 tokens in prefill there
    assert alone.free_by_replica["b"] == 1.0  # nothing of ours there: one at least
    full = capacity(replicas, count, t, 1024.0, alone=True, reserved_tokens={"a": 2048})
    assert full.free_by_replica["a"] <= 0
    # another gateway's prefill counts in tokens too
    assert capacity([_Replica("c", 1500)], {}, t, 1024.0, True, {}).free
    assert not capacity([_Replica("c", 2100)], {}, t, 1024.0, True, {}).free
    # alone, a request held on its holders takes any free slot (the scheduler spills it)
    assert full.free_for(("a",)) and not fair.free_for(("a",))


def test_contention_starts_with_a_second_tenant_and_ends_a_window_after() -> None:
    c = Contention(window_s=10.0)
    c.seen("m", "a", 0.0)
    c.seen("m", "a", 5.0)
    assert c.alone("m", 5.0)
    c.seen("m", "b", 6.0)
    assert not c.alone("m", 6.0) and not c.alone("m", 15.9)
    assert c.alone("other-model", 6.0)
    c.seen("m", "b", 7.0)  # the same tenant again: no new contention
    assert c.alone("m", 16.0)
