"""Fleet mode: acting on the stream leases (``ownership``): renewing, claiming, losing, and a
new owner's catch-up of the shared index (from its log of the writes it skipped, or a rewrite
of the replica's shared entry from its exact holder set)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from router.kv_events.apply import IndexHandle, do
from router.kv_events.ownership import StreamLeases
from router.kv_events.streams import Stream

log = logging.getLogger("prefix_router.kv_events")

RESYNC_CHUNK = 2048  # blocks per shared write when a takeover rewrites a replica's entry


class Takeovers:
    def __init__(
        self,
        leases: StreamLeases,
        handle: IndexHandle,
        streams: Callable[[], dict[str, Stream]],
        capacity_for: Callable[[Stream, int], int],
        owned_gauge: Callable[[Stream], None],
        changed: Callable[[], None],
    ) -> None:
        self.leases = leases
        self.handle = handle
        self._streams = streams
        self._capacity_for = capacity_for
        self._owned_gauge = owned_gauge
        self._changed = changed
        self._transitions = handle.transitions

    async def tick(self) -> None:
        """Renew, claim or lose each stream's lease; a stream newly owned is caught up into
        the shared index first."""
        handle, leases = self.handle, self.leases
        streams = dict(self._streams())
        if handle.transitions != self._transitions or not handle.writes_shared:
            # Shared writes were skipped meanwhile: owned streams catch up as on a takeover.
            self._transitions = handle.transitions
            for stream in streams.values():
                stream.owned = False
        up = handle.writes_shared
        wanted = {  # no claims while shared writes would be skipped: a catch-up must land
            url: (leases.mode(url, s.owned) if up else "peek", s.written if s.owned else "")
            for url, s in streams.items()
        }
        views = await leases.tick(wanted)
        if views is None:
            for stream in streams.values():
                stream.owned = False
                self._owned_gauge(stream)
            self._changed()
            return
        for url, view in views.items():
            stream = streams[url]
            stream.holder = view.holder
            if view.mine and not stream.owned:
                await self._take_over(stream, view.stamp)
            elif not view.mine and stream.owned:
                log.info("KV events for %s: now written by gateway %s", url, view.holder)
                stream.owned = False
        for stream in streams.values():
            self._owned_gauge(stream)
        self._changed()

    async def _take_over(self, stream: Stream, stamp: str) -> None:
        """Bring the shared index up to this gateway's view of the stream: replay the logged
        writes of the batches after ``stamp`` (the last batch the previous owner wrote), or,
        when the log does not reach back to it, rewrite the replica's shared entry."""
        handle = self.handle
        transitions = handle.transitions
        async with stream.lock:
            log_ = list(stream.oplog)
            at = next((i for i in range(len(log_) - 1, -1, -1) if log_[i][0] == stamp), None)
            if at is not None:
                for _, ops in log_[at + 1 :]:
                    for op in ops:
                        await do(handle.index, stream.url, op)
                stream.caught_up += len(log_) - at - 1
            else:
                await self._resync(stream)
            if stream.capacity is not None:  # the shared entry sized as this gateway sizes it
                await handle.index.set_capacity(
                    stream.url, self._capacity_for(stream, stream.capacity)
                )
            if handle.transitions != transitions:
                return  # Redis failed meanwhile: writes were lost; the next tick tries again
            stream.owned = True
            stream.takeovers += 1
        log.info(
            "KV events for %s: this gateway writes them now (%s)",
            stream.url,
            "caught up from the log" if at is not None else "shared entry rewritten",
        )

    async def _resync(self, stream: Stream) -> None:
        stream.resyncs += 1
        shared = self.handle.shared
        if shared is None:
            return
        primary, url = shared.primary, stream.url
        await shared.write_primary("resync", lambda: primary.drop_replica(url))
        held = list(stream.holders)
        for i in range(0, len(held), RESYNC_CHUNK):
            await shared.write_primary(
                "resync", functools.partial(primary.record, url, held[i : i + RESYNC_CHUNK])
            )
