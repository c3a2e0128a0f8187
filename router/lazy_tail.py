"""The gateway's side of the lazy tail (router/prompt/lazy.py): route on a prompt's head,
finish tokenizing it off the request's critical path.

A request prepared lazily carries the head's ids and block hashes, ``tail_tokens`` (an
estimate of the rest's count) and a ``Tail`` (router/request.py) in ``tail``. ``decide`` uses the head
only when the index shows a block of it that no candidate holds (``Tail.decides``): chained
hashes mean none holds anything after it either, so the full hashes would match exactly the
same counts. Otherwise it waits for the full ids (exact, just not lazy). Everything after the
decision that keeps state (the index record, learning, diagnostics, metrics) uses the full
request: a small rest (``Tail.finish_inline``) is tokenized on the loop as soon as the request
is sent, before its placement is recorded; a large one in a worker thread.
"""

from __future__ import annotations

from typing import Any

from router.request import RoutedRequest, Tail

__all__ = ["Tail", "latest", "pending", "policy_allows", "tail_of"]

# Scorers whose terms are integers (token and request counts), so that with integral
# weights every cost is an exactly represented integer and adding the same number to every
# candidate's ``uncached_prefill`` (the estimate of the untokenized rest) changes no
# comparison. Filters and pickers here never read the prompt length (replica_set_bound reads
# only block 0's key and whether a candidate holds a block, as ring_spill's picker does).
_INTEGER_SCORERS = frozenset({"uncached_prefill", "queued_tokens", "inflight"})
_LENGTH_BLIND_FILTERS = frozenset({"load_bound", "recent_share", "replica_set_bound"})
_LENGTH_BLIND_PICKERS = frozenset(
    {
        "random_min",
        "random_pick",
        "ring_min_cost",
        "ring_owner",
        "ring_spill",
        "round_robin",
        "sticky_prefix",
    }
)


def policy_allows(policy: Any) -> str | None:
    """None if ``policy`` decides the same with any prompt length at least the head's and
    the same matched blocks (the proof above), else why it may not."""
    scorers = getattr(policy, "scorers", None)
    if scorers is None:
        return "not a pipeline policy"
    for scorer, weight in scorers:
        if weight == 0:
            continue  # 0.0 x a finite score is exactly 0.0
        if scorer.name not in _INTEGER_SCORERS or not float(weight).is_integer():
            return f"scorer {scorer.name} (weight {weight}) is not integer-valued"
    for f in policy.filters:
        if f.name not in _LENGTH_BLIND_FILTERS:
            return f"filter {f.name} is not known to ignore the prompt length"
    picker = policy.picker
    if picker.name not in _LENGTH_BLIND_PICKERS:
        return f"picker {picker.name} is not known to ignore the prompt length"
    cap = getattr(picker, "cap", 0)
    if not float(cap).is_integer():
        return f"picker {picker.name}'s cap {cap} is not an integer"
    return None


def tail_of(rr: RoutedRequest) -> Tail | None:
    return rr.tail


def latest(rr: RoutedRequest) -> RoutedRequest:
    """The full request if its tail is done, else ``rr`` as it is."""
    tail = tail_of(rr)
    return tail.full if tail is not None and tail.full is not None else rr


def pending(rr: RoutedRequest) -> bool:
    """Whether ``rr`` is a head whose full ids are not in yet."""
    tail = tail_of(rr)
    return tail is not None and tail.full is None
