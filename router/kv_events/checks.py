"""Checking placements against the events (``placements`` holds them): what a due placement
recorded and the events do not hold, nor another placement still waits for, is retracted.

While a stream is down the approximate model keeps its placements (they are all it has):
they stay, and are checked once the events are back, whatever was applied meanwhile. A
request the replica refused (a 4xx: vLLM validates before scheduling) is checked at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from router.kv_events.apply import IndexHandle
from router.kv_events.streams import Stream

PLACED_BLOCKS = 65_536  # unconfirmed placement blocks per replica of unknown size


class Checks:
    def __init__(
        self,
        handle: IndexHandle,
        metrics: Any,
        *,
        timeout_s: float,
        settle_s: float,
        changed: Callable[[], None],
    ) -> None:
        self.handle = handle
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._changed = changed

    def expect(self, stream: Stream, block_hashes: Sequence[int]) -> None:
        """A placement: checked ``timeout_s`` from now, or ``settle_s`` after its request's
        outcome (``settle``), whichever first."""
        stream.placements.add(time.monotonic() + self.timeout_s, block_hashes)

    def settle(self, stream: Stream, block_hashes: Sequence[int]) -> None:
        """The request placed with ``block_hashes`` was answered (or failed)."""
        stream.placements.settle(time.monotonic() + self.settle_s, block_hashes)

    async def reject(self, stream: Stream, block_hashes: Sequence[int]) -> None:
        """The replica refused the request: nothing of it will be stored; check it now."""
        now = time.monotonic()
        stream.placements.settle(now, block_hashes)
        await self.check(stream, now, force=True)
        if not stream.placements:
            stream.expect_since = None  # no events are due: silence is not an outage

    def limit(self, stream: Stream) -> int:
        """Blocks of unconfirmed placements kept per replica: its size (twice over, a block
        being counted by each placement of it), so the index stays within twice the size."""
        return 2 * stream.capacity if stream.capacity else PLACED_BLOCKS

    @staticmethod
    def behind(stream: Stream) -> bool:
        """Events received but not applied yet: a batch being applied, or messages waiting
        on the SUB socket. (In fleet mode the owner may already have written them to Redis,
        where a retraction now would undo its record.)"""
        if stream.lock.locked():
            return True
        sub = stream.sub
        try:
            return sub is not None and bool(int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    async def check(self, stream: Stream, now: float, *, force: bool = False) -> None:
        """Retract what the placements now due recorded and the events do not hold. Down
        (unless ``force``), they are kept for when the events are back; only the oldest past
        the limit go (the approximate model's LRU still has their blocks)."""
        placements = stream.placements
        if not stream.up and not force:
            placements.due(float("-inf"), self.limit(stream))
            return
        due = placements.due(now, self.limit(stream))
        if not due:
            return
        if self.behind(stream):  # the confirming events may be waiting: not yet
            for hashes in due:
                placements.add(now + self.settle_s, hashes)
            return
        held = stream.holders
        gone = list(
            dict.fromkeys(
                h for hashes in due for h in hashes if h not in held and h not in placements
            )
        )
        if not gone:
            return
        # Counted: those still in the local copy (the rest the events already removed).
        # Forgotten: all of them, for a shared index where a placement's record may have
        # landed after the owner's removal. The local copy's reads and write do not suspend,
        # so no event is applied in between.
        handle, url = self.handle, stream.url
        lingering = sum([(await handle.local.match([h], [url])).get(url, 0) for h in gone])
        placements.retracted += lingering
        if self.metrics is not None and lingering:
            self.metrics.kv_events_retracted.labels(url).inc(lingering)
        if not handle.writes_shared:
            # The shared index would skip the write: the local copy now, the whole check
            # again later (what is then still not held is forgotten in Redis too).
            await handle.local.forget(url, gone)
            for hashes in due:
                placements.add(now + self.settle_s, hashes)
        else:
            # Logged: a takeover's catch-up replays it like the events' writes.
            stream.oplog.append(("~", [("forget", gone)]))
            await handle.index.forget(url, gone)
        self._changed()
