"""The gateway's index in precise mode: the index the events keep, with the gateway's own
writes adjusted to them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from router.index.base import PrefixIndex
from router.index.resilient import ResilientIndex
from router.kv_events.streams import Stream


class EventFeed(Protocol):
    """What the index needs of the subscriber (``KVEventSubscriber``)."""

    @property
    def streams(self) -> dict[str, Stream]: ...

    @property
    def local(self) -> PrefixIndex:
        """This gateway's own copy (fleet mode: a non-owned stream's entry lives there)."""
        ...

    def placed(self, url: str) -> None: ...

    def expect(self, stream: Stream, block_hashes: Sequence[int]) -> None: ...

    def capacity_for(self, stream: Stream, blocks: int) -> int: ...

    async def restart(self, stream: Stream, why: str) -> None: ...


class PreciseIndex:
    """The gateway's ``PrefixIndex`` in precise mode: the index the events keep, with the
    gateway's own writes adjusted to them (see the package doc)."""

    def __init__(self, inner: PrefixIndex, feed: EventFeed) -> None:
        self.inner = inner
        self.feed = feed

    @property
    def fallbacks(self) -> int:
        """Matches the local copy answered (fleet mode's resilient index), for /metrics."""
        return self.inner.fallbacks if isinstance(self.inner, ResilientIndex) else 0

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        return await self.inner.match(block_hashes, replicas)

    def offloaded(self, block_hashes: Sequence[int], matches: Mapping[str, int]) -> dict[str, int]:
        """For each replica of ``matches`` (its GPU match), the blocks right after that match
        an offload tier holds: vLLM loads them rather than recomputing them, and reports them
        in ``cached_tokens`` (router/kv_events/tiers.py). A replica whose stream is down: none
        (the tier's state is as old as the stream's)."""
        out = {}
        streams = self.feed.streams
        for url, m in matches.items():
            stream = streams.get(url)
            if stream is not None and stream.up and stream.tiers:
                n = stream.tiers.run(block_hashes, m)
                if n:
                    out[url] = n
        return out

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        stream = self.feed.streams.get(replica)
        if stream is not None and block_hashes:
            if block_hashes[-1] not in stream.holders:
                self.feed.placed(replica)  # blocks the replica will store: events are due
            self.feed.expect(stream, block_hashes)  # retracted unless events confirm
        await self.inner.record(replica, block_hashes)

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        stream = self.feed.streams.get(replica)
        if stream is not None and stream.up:
            held = stream.holders
            block_hashes = [h for h in block_hashes if h not in held]
        await self.inner.forget(replica, block_hashes)

    async def set_capacity(self, replica: str, blocks_: int) -> None:
        stream = self.feed.streams.get(replica)
        if stream is not None:
            stream.capacity = blocks_
            blocks_ = self.feed.capacity_for(stream, blocks_)
            if not stream.owned:  # fleet mode: the stream's owner sizes the shared entry
                await self.feed.local.set_capacity(replica, blocks_)
                return
        await self.inner.set_capacity(replica, blocks_)

    async def drop_replica(self, replica: str) -> None:
        """The replica restarted or left (or its reports contradict the index): what the
        events taught about it goes too, and its stream is resynced from the publisher's
        seq 0 (which drops the entry, in order with the stream's own writes)."""
        stream = self.feed.streams.get(replica)
        if stream is not None:
            await self.feed.restart(stream, "the replica restarted (or left)")
        else:
            await self.inner.drop_replica(replica)

    def size(self, replica: str) -> int:
        return self.inner.size(replica)

    async def close(self) -> None:
        await self.inner.close()
