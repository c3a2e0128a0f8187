"""Events to index writes: a batch's events applied to the stream's holders, its writes to the
index after them (consecutive removals merged into one ``forget``); resets and rebuilds.

A batch is decoded and applied a slice at a time, yielding to the loop between slices: a
40 MB batch of 3.9M events decoded at once held ``/health`` for 0.7 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.core import blocks
from router.index.base import PrefixIndex, SharedIndex
from router.index.resilient import ResilientIndex
from router.kv_events.holders import counts
from router.kv_events.streams import Op, Stream
from router.kv_events.tiers import MAX_TIER_BLOCKS, offload_tier
from router.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Skipped,
    WireError,
    digest,
    iter_events,
)

log = logging.getLogger("prefix_router.kv_events")

CHECK_EVERY = 64  # events between two looks at the clock
SLICE_S = 0.001  # a batch yields to the loop after this much work
REBUILD_CHUNK = 2048  # blocks per write when an entry is rebuilt


@dataclass(frozen=True)
class IndexHandle:
    """Where a stream's writes go: ``index`` (the gateway's, shared in fleet mode) when this
    gateway owns the stream, else ``local`` (its own copy); ``shared`` in fleet mode."""

    index: PrefixIndex
    local: PrefixIndex
    shared: SharedIndex | None

    @classmethod
    def of(cls, index: PrefixIndex) -> IndexHandle:
        if isinstance(index, ResilientIndex):
            return cls(index, index.local, index)
        return cls(index, index, None)

    def target(self, stream: Stream) -> PrefixIndex:
        return self.index if stream.owned else self.local

    @property
    def writes_shared(self) -> bool:
        """Whether a write to ``index`` reaches the shared index now."""
        return self.shared is None or self.shared.redis_up

    @property
    def transitions(self) -> int:
        return self.shared.transitions if self.shared is not None else 0


async def do(index: PrefixIndex, url: str, op: Op) -> None:
    kind, arg = op
    if kind == "record":
        await index.record(url, arg)
    elif kind == "forget":
        await index.forget(url, arg)
    elif kind == "drop":
        await index.drop_replica(url)
    elif kind == "capacity":
        await index.set_capacity(url, arg[0])


class Applier:
    def __init__(
        self,
        handle: IndexHandle,
        block_size: Callable[[str], int],
        count: Callable[[Stream, str, int], None],
        capacity_for: Callable[[Stream, int], int],
        *,
        namespace: Callable[[str], str | None] | None = None,
    ) -> None:
        self.handle = handle
        # A replica's model's block size and index namespace (router/models/): its blocks
        # are keyed as the gateway keys that model's requests.
        self._block_size = block_size
        self._namespace = namespace or (lambda url: None)
        self.count = count
        self._capacity_for = capacity_for

    async def apply(self, stream: Stream, seq: int, payload: bytes) -> None:
        """One batch: its events to the holders, then its writes to the index, logged."""
        stream.last_applied = seq
        stream.last_crc = digest(payload)
        stream.batches += 1
        ops: list[Op] = []
        stream.oplog.append((f"{seq}:{stream.last_crc}", ops))
        stream.applying = True
        shared = stream.owned
        skipped: dict[str, int] = {}  # counted once per batch: junk stays cheap
        sliced = time.perf_counter()
        try:
            for i, event in enumerate(iter_events(payload), 1):
                if isinstance(event, BlockStored):
                    self._stored(stream, event, ops)
                elif isinstance(event, BlockRemoved):
                    self._removed(stream, event, ops)
                elif isinstance(event, AllBlocksCleared):
                    stream.holders.clear()
                    # The offload tier may or may not have been reset with it (vLLM's
                    # reset_connector; its reset publishes nothing): doubt forgets.
                    stream.tiers.clear()
                    stream.placements.clear()  # the entry is dropped: nothing to retract
                    stream.resets += 1
                    ops.clear()  # nothing before the clear survives it
                    ops.append(("drop", []))
                    if stream.capacity is not None:
                        cap = self._capacity_for(stream, stream.capacity)
                        ops.append(("capacity", [cap]))
                elif isinstance(event, Skipped):
                    skipped[event.reason] = skipped.get(event.reason, 0) + 1
                if i % CHECK_EVERY == 0 and time.perf_counter() - sliced > SLICE_S:
                    await asyncio.sleep(0)  # a huge batch must not hold the loop
                    sliced = time.perf_counter()
        except WireError as e:
            self.count(stream, e.reason, 1)
        finally:
            stream.applying = False
        for reason, n in skipped.items():
            self.count(stream, reason, n)
        index = self.handle.target(stream)
        for op in ops:
            await do(index, stream.url, op)
        stream.written = stream.oplog[-1][0]
        stream.shared_batches += shared and bool(ops)

    async def write(self, stream: Stream, op: Op) -> None:
        """One write between batches (a reset, a retraction): done now, logged as an entry
        no stamp names, so a takeover's catch-up replays it too."""
        stream.oplog.append(("~", [op]))
        await do(self.handle.target(stream), stream.url, op)

    async def reset(self, stream: Stream, why: str) -> None:
        """Drop what the events taught about the replica: the events that follow rebuild it."""
        log.info("KV events for %s: %s; dropping its index entries", stream.url, why)
        stream.resets += 1
        stream.holders.clear()
        stream.tiers.clear()
        stream.placements.clear()  # the entry is dropped: nothing of theirs to retract
        await self.write(stream, ("drop", []))
        if stream.capacity is not None:
            cap = self._capacity_for(stream, stream.capacity)
            await self.write(stream, ("capacity", [cap]))

    async def rebuild(self, stream: Stream) -> None:
        """Make the replica's index entry what the events say it holds, plus the placements
        they have yet to confirm: after an outage, where the approximate model trimmed it in
        its own LRU order (vLLM evicts a request's tail first; the index did not)."""
        stream.rebuild = False
        stream.rebuilds += 1
        held = list(stream.holders)
        held += [h for h in stream.placements.hashes() if h not in stream.holders]
        await self.write(stream, ("drop", []))
        if stream.capacity is not None:
            await self.write(stream, ("capacity", [self._capacity_for(stream, stream.capacity)]))
        for i in range(0, len(held), REBUILD_CHUNK):
            await self.write(stream, ("record", held[i : i + REBUILD_CHUNK]))

    # -- events ---------------------------------------------------------------------------
    def _stored(self, stream: Stream, ev: BlockStored, ops: list[Op]) -> None:
        if not counts(ev.medium, ev.group_idx):
            if offload_tier(ev.medium, ev.group_idx):
                self._offloaded(stream, ev)
            else:
                stream.other_tier_blocks += len(ev.block_hashes)
            return
        if ev.block_size != self._block_size(stream.url):
            self.count(stream, "block_size", 1)
            return
        holders = stream.holders
        if ev.parent_block_hash is None:
            parent = blocks.root_hash(ev.cache_salt(), ev.lora_name, self._namespace(stream.url))
        else:
            found = holders.parent(ev.parent_block_hash)
            if found is None:
                self.count(stream, "unknown_parent", 1)
                return
            parent = found
        gws = blocks.continue_chain(parent, ev.token_ids, ev.block_size)
        holders.store(ev.block_hashes, gws)
        ops.append(("record", gws))

    def _offloaded(self, stream: Stream, ev: BlockStored) -> None:
        """An offload tier's copies (router/kv_events/tiers.py): each vLLM hash mapped to the
        gateway's through the GPU's mapping, or the chain from a known parent."""
        tiers, holders, n = stream.tiers, stream.holders, len(ev.block_hashes)
        if len(tiers) + n > MAX_TIER_BLOCKS:
            self.count(stream, "tier_full", n)
            return
        gws: list[int | None] = []
        for vh in ev.block_hashes:
            gh = holders.parent(vh)
            gws.append(tiers.parent(vh) if gh is None else gh)
        if None in gws and ev.parent_block_hash is not None and ev.block_size:
            parent = holders.parent(ev.parent_block_hash)
            if parent is None:
                parent = tiers.parent(ev.parent_block_hash)
            if parent is not None and ev.block_size == self._block_size(stream.url):
                gws = list(blocks.continue_chain(parent, ev.token_ids, ev.block_size))
        known = [(vh, gh) for vh, gh in zip(ev.block_hashes, gws, strict=True) if gh is not None]
        if len(known) < n:
            self.count(stream, "unknown_block", n - len(known))
        if known:
            medium = ev.medium or "CPU"  # offload_tier: never GPU here
            tiers.store(medium, [vh for vh, _ in known], [gh for _, gh in known])

    def _removed(self, stream: Stream, ev: BlockRemoved, ops: list[Op]) -> None:
        if not counts(ev.medium, ev.group_idx):
            if ev.medium is not None and offload_tier(ev.medium, ev.group_idx):
                stream.tiers.remove(ev.medium, ev.block_hashes)
            return
        gone = stream.holders.remove(ev.block_hashes)
        if gone:
            if ops and ops[-1][0] == "forget":
                ops[-1][1].extend(gone)  # removals commute: one write
            else:
                ops.append(("forget", gone))
