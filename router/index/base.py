"""The ``PrefixIndex`` interface: one per gateway, memory or Redis behind it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PrefixIndex(Protocol):
    """A model of every replica's prefix cache, keyed by chained block hashes.

    Because block i's hash chains over blocks 0..i-1, a replica that holds block i is assumed to
    hold all blocks before it (the engine evicts least-recently-used first, and a request's
    earlier blocks are always touched with its later ones). Implementations may use this to
    binary-search the match instead of probing every block.
    """

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """For each of ``replicas``, how many leading blocks of ``block_hashes`` it holds."""
        ...

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        """``replica`` now holds these blocks (most recently used); evict past capacity."""
        ...

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        """``replica`` no longer holds these blocks (learned from reported cached tokens)."""
        ...

    async def set_capacity(self, replica: str, blocks: int) -> None:
        """How many blocks ``replica``'s cache holds (``num_gpu_blocks``); trims to fit."""
        ...

    async def drop_replica(self, replica: str) -> None:
        """Forget everything about ``replica`` (removed from the fleet, or restarted)."""
        ...

    def size(self, replica: str) -> int:
        """Blocks currently modelled for ``replica`` (for metrics; may be approximate)."""
        ...

    async def close(self) -> None: ...


class SharedIndex(PrefixIndex, Protocol):
    """A shared index (fleet mode: Redis) in front of this gateway's own copy, as the KV event
    subscriber uses it (``router.index.resilient.ResilientIndex``)."""

    @property
    def local(self) -> PrefixIndex:
        """This gateway's copy: every write lands here, reads fall back to it."""
        ...

    @property
    def primary(self) -> PrefixIndex:
        """The shared index itself."""
        ...

    @property
    def redis_up(self) -> bool:
        """Whether writes reach the primary now (else they are skipped)."""
        ...

    @property
    def transitions(self) -> int:
        """Up->down and down->up changes so far (writes were skipped in between)."""
        ...

    async def write_primary(self, what: str, make: Callable[[], Awaitable[Any]]) -> bool:
        """A write to the primary alone; True if it landed."""
        ...
