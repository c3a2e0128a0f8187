"""The gateway's side of the lazy tail (router/prompt/lazy.py): route on a prompt's head,
finish tokenizing it off the request's critical path.

A request prepared lazily carries the head's ids and block hashes, ``tail_tokens`` (an
estimate of the rest's count) and a ``Tail`` (router/intake/routed_request.py) in ``tail``. ``decide`` uses
the head only when the index shows a block of it that no candidate holds (``Tail.decides``): chained
hashes mean none holds anything after it either, so the full hashes would match exactly the
same counts. Otherwise it waits for the full ids (exact, just not lazy). Everything after the
decision that keeps state (the index record, learning, diagnostics, metrics) uses the full
request: a small rest (``Tail.finish_inline``) is tokenized on the loop as soon as the request
is sent, before its placement is recorded; a large one in a worker thread.

With the same matched blocks, the head decides as the whole prompt would when every plugin
is exact on a head (``Plugin.exact_on_head``): filters and pickers never read the prompt's
length, and scorers' terms are integers under integral weights, so every cost is an exactly
represented integer and the estimate of the rest, added alike to every candidate's
``uncached_prefill``, changes no comparison.
"""

from __future__ import annotations

from router.intake.routed_request import RoutedRequest, Tail
from router.schedule import Pipeline

__all__ = ["Tail", "latest", "pending", "policy_allows", "tail_of"]


def policy_allows(policy: Pipeline) -> str | None:
    """None if ``policy`` decides the same with any prompt length at least the head's and
    the same matched blocks (the proof above), else why it may not: every plugin says so
    itself (``Plugin.exact_on_head``), and a scorer's weight must keep its integer terms
    integers."""
    for scorer, weight in policy.scorers:
        if weight == 0:
            continue  # 0.0 x a finite score is exactly 0.0
        if not scorer.exact_on_head or not float(weight).is_integer():
            return f"scorer {scorer.name} (weight {weight}) is not integer-valued"
    for f in policy.filters:
        if not f.exact_on_head:
            return f"filter {f.name} is not known to ignore the prompt length"
    if not policy.picker.exact_on_head:
        return f"picker {policy.picker.name} is not known to ignore the prompt length"
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
