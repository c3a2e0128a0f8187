"""Placements whose blocks the events have yet to confirm, per replica stream (precise mode).

The gateway records a prompt's blocks when it places a request (a second request for the same
prefix must follow the first before the replica's events arrive). Each placement is checked
again later, and whatever of it the events do not say is held is retracted: at its request's
outcome plus ``settle_s`` (the replica scheduled it, so its ``BlockStored`` was published; the
margin covers the stream's lag), or, with no outcome, ``timeout_s`` after the placement. A
block retracted early (a stream lagging past the margin) is recorded again by its store event.
So in precise mode the index is what the events say plus, at most, the placements whose events
are still due, ``limit`` blocks at most (the oldest are checked early past it).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any


class Placements:
    """A deadline heap of placements (block hash lists) and their total block count. An entry
    is found again by its list's identity (the same list reaches the outcome), so settling a
    placement moves its deadline instead of adding a second entry."""

    def __init__(self) -> None:
        # [deadline, order, hashes, valid]; a moved entry is invalidated and pushed anew
        self._heap: list[list[Any]] = []
        self._by_list: dict[int, list[Any]] = {}
        # The newest entry per last block hash: an answered request settles every placement
        # that is a prefix of its prompt (a chained hash names its whole prefix), such as the
        # lazy tail's head record, made before the rest of the prompt was tokenized.
        self._by_last: dict[int, list[Any]] = {}
        self._order = itertools.count()
        # block -> valid entries placing it: a check spares what another placement still
        # waits for (two requests for one prefix, one of them rejected)
        self._pending: dict[int, int] = {}
        self.blocks = 0  # blocks over the valid entries (a block placed twice counts twice)
        self.retracted = 0  # blocks retracted so far

    def __len__(self) -> int:
        return len(self._by_list)

    def __contains__(self, block_hash: int) -> bool:
        """Whether some placement not checked yet placed this block."""
        return block_hash in self._pending

    def hashes(self) -> list[int]:
        """Every block some placement not checked yet placed."""
        return list(self._pending)

    def add(self, deadline: float, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            entry = [deadline, next(self._order), block_hashes, True]
            heapq.heappush(self._heap, entry)
            self._by_list[id(block_hashes)] = entry  # the entry keeps the list (and its id)
            self._by_last[block_hashes[-1]] = entry
            self.blocks += len(block_hashes)
            pending = self._pending
            for h in block_hashes:
                pending[h] = pending.get(h, 0) + 1

    def _unpend(self, block_hashes: Sequence[int]) -> None:
        pending = self._pending
        for h in block_hashes:
            n = pending.get(h, 0) - 1
            if n > 0:
                pending[h] = n
            else:
                pending.pop(h, None)

    def settle(self, deadline: float, block_hashes: Sequence[int]) -> bool:
        """The placement's request is answered: check it, and every placement of a prefix of
        its prompt, at ``deadline`` if that is sooner. False when no entry holds this list
        (placed while the stream was down, or checked)."""
        mine = self._by_list.get(id(block_hashes))
        found = mine is not None and mine[2] is block_hashes
        entries: list[list[Any]] = [mine] if mine is not None and found else []
        by_last = self._by_last
        if by_last:
            for h in block_hashes:
                entry = by_last.get(h)
                if entry is not None and entry is not mine and entry[3]:
                    entries.append(entry)
        for due in entries:
            if deadline < due[0]:
                hashes = due[2]
                due[3] = False
                self.blocks -= len(hashes)
                self._unpend(hashes)
                self.add(deadline, hashes)
        return found

    def due(self, now: float, limit: int) -> list[Sequence[int]]:
        """Take the placements due by ``now``, and the oldest past ``limit`` blocks."""
        heap, out = self._heap, []
        while heap and (heap[0][0] <= now or self.blocks > limit or not heap[0][3]):
            entry = heapq.heappop(heap)
            if not entry[3]:
                continue
            hashes = entry[2]
            self.blocks -= len(hashes)
            self._unpend(hashes)
            if self._by_list.get(id(hashes)) is entry:
                del self._by_list[id(hashes)]
            if self._by_last.get(hashes[-1]) is entry:
                del self._by_last[hashes[-1]]
            out.append(hashes)
        return out

    def clear(self) -> None:
        self._heap.clear()
        self._by_list.clear()
        self._by_last.clear()
        self._pending.clear()
        self.blocks = 0


class SettleOnOutcome:
    """A gateway observer (``Gateway.observers``): each answered request settles its
    placement (``KVEventSubscriber.settle``); one the replica refused (a 4xx: vLLM validates
    before it schedules anything) is checked at once (``KVEventSubscriber.reject``)."""

    def __init__(
        self,
        settle: Callable[[str, Sequence[int]], None],
        reject: Callable[[str, Sequence[int]], None],
    ) -> None:
        self._settle = settle
        self._reject = reject

    def observe(self, rr: Any, decision: Any, outcome: Any) -> None:
        if 400 <= outcome.status < 500:
            self._reject(decision.replica, rr.block_hashes)
        else:
            self._settle(decision.replica, rr.block_hashes)
