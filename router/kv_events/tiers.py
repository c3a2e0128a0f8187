"""What one replica's offload tiers hold (vLLM's offloading connector, LMCache): per medium
("CPU", "STORAGE"), vLLM hash -> gateway hash with its holder count, as ``Holders`` keeps
the GPU's.

vLLM's offloading connector copies each computed prompt block to the CPU as it is computed
and publishes the copy with ``medium`` "CPU" once it landed, in the same batch as the engine's
GPU events, after them (vllm/v1/core/sched/scheduler.py:2689-2704). By default the event is a
placeholder: the offloaded chunk's hash, no parent, no tokens, ``block_size`` 0
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py:490-520); with
``self_describing_kv_events`` it carries the chunk's hashes, parent and tokens, but no
extra keys (so no ``cache_salt``). Either way the gateway hash comes from the GPU's mapping
of the same vLLM hash (the block was on the GPU first), or from the chain when the event
names a parent the gateway knows; a hash neither resolves is skipped and counted.

A later request hits on the GPU's leading run, then loads the tier's consecutive chunks
after it (offloading/scheduler.py:904-1125, ``_lookup_complete_chunks``): ``run`` counts
those. Kept in this gateway's memory only: in fleet mode every gateway follows every stream.
Pure bookkeeping: no I/O, no awaits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.kv_events.holders import PRIMARY_GROUP, Holders
from router.kv_events.wire import MEDIUM_GPU, Hash

MAX_TIER_BLOCKS = 1 << 21  # per replica, every tier: a hostile publisher's stores stop here


def offload_tier(medium: str | None, group_idx: int | None) -> bool:
    """Whether an event of this medium and group is an offload tier's (of the primary group)."""
    return medium not in (None, MEDIUM_GPU) and group_idx in (None, PRIMARY_GROUP)


class Tiers:
    __slots__ = ("by_medium",)

    def __init__(self) -> None:
        self.by_medium: dict[str, Holders] = {}

    def __len__(self) -> int:
        return sum(len(h.held) for h in self.by_medium.values())

    def __bool__(self) -> bool:
        return any(h.gw for h in self.by_medium.values())

    def parent(self, vh: Hash) -> int | None:
        """The gateway hash a tier knows for ``vh`` (held or recently removed)."""
        for holders in self.by_medium.values():
            found = holders.parent(vh)
            if found is not None:
                return found
        return None

    def store(self, medium: str, vhashes: Sequence[Hash], gws: Sequence[int]) -> None:
        self.by_medium.setdefault(medium, Holders()).store(vhashes, gws)

    def remove(self, medium: str, vhashes: Iterable[Hash]) -> None:
        holders = self.by_medium.get(medium)
        if holders is not None:
            holders.remove(vhashes)

    def holds(self, gateway_hash: int) -> bool:
        return any(gateway_hash in h for h in self.by_medium.values())

    def run(self, block_hashes: Sequence[int], start: int) -> int:
        """Blocks of ``block_hashes`` from ``start`` on that some tier holds, consecutively."""
        tiers = [h.gw for h in self.by_medium.values() if h.gw]
        n = 0
        for gh in block_hashes[start:]:
            if not any(gh in t for t in tiers):
                break
            n += 1
        return n

    def sizes(self) -> dict[str, int]:
        """Blocks held per medium (gateway hashes), for explain and /ready detail."""
        return {m: len(h) for m, h in sorted(self.by_medium.items()) if len(h)}

    def clear(self) -> None:
        for holders in self.by_medium.values():
            holders.clear()
