"""Where a request whose prefix nobody holds may take a prefill slot (pure: no sockets)."""

from __future__ import annotations

from router.flow.saturation import Capacity, Waiting


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
