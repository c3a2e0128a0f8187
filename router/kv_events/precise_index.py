"""The gateway's index in precise mode: the index the events keep, with the gateway's own
writes adjusted to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from router.index.base import PrefixIndex

if TYPE_CHECKING:
    from router.kv_events.subscriber import KVEventSubscriber


class PreciseIndex:
    """The gateway's ``PrefixIndex`` in precise mode: the index the events keep, with the
    gateway's own writes adjusted to them (see the module doc)."""

    def __init__(self, inner: PrefixIndex, subscriber: KVEventSubscriber) -> None:
        self.inner = inner
        self.subscriber = subscriber

    def __getattr__(self, name: str) -> Any:  # redis_up, fallbacks... of a ResilientIndex
        return getattr(self.inner, name)

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        return await self.inner.match(block_hashes, replicas)

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        stream = self.subscriber.streams.get(replica)
        if stream is not None and block_hashes:
            if block_hashes[-1] not in stream.gw_holders:
                self.subscriber.placed(replica)  # blocks the replica will store: events are due
            self.subscriber.expect(stream, block_hashes)  # retracted unless events confirm
        await self.inner.record(replica, block_hashes)

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        stream = self.subscriber.streams.get(replica)
        if stream is not None and stream.up:
            held = stream.gw_holders
            block_hashes = [h for h in block_hashes if h not in held]
        await self.inner.forget(replica, block_hashes)

    async def set_capacity(self, replica: str, blocks_: int) -> None:
        stream = self.subscriber.streams.get(replica)
        if stream is not None:
            stream.capacity = blocks_
            blocks_ = self.subscriber.capacity_for(stream, blocks_)
            if not stream.owned:  # fleet mode: the stream's owner sizes the shared entry
                await self.subscriber.local.set_capacity(replica, blocks_)
                return
        await self.inner.set_capacity(replica, blocks_)

    async def drop_replica(self, replica: str) -> None:
        """The replica restarted or left (or its reports contradict the index): what the
        events taught about it goes too; the events that follow rebuild it."""
        stream = self.subscriber.streams.get(replica)
        if stream is not None:
            self.subscriber.restart(stream)
        await self.inner.drop_replica(replica)

    def size(self, replica: str) -> int:
        return self.inner.size(replica)

    async def close(self) -> None:
        await self.inner.close()
