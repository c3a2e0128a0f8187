"""The in-memory index moves a prompt's held run with a C-level loop (router/index/memory.py):
its LRU order, and so what it evicts and what it matches, is exactly that of touching the
blocks one by one, including where the held set is not prefix-closed (forgotten blocks,
a chain's tail held without its head)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from router.index.memory import MemoryIndex


class _OneByOne:
    """The reference: the index's previous touch, one block at a time."""

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def touch(self, block_hashes: Sequence[int]) -> None:
        for h in reversed(block_hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


_chains = st.lists(st.integers(0, 6), min_size=1, max_size=12)  # a chain is a path of ids
_ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "twice", "forget", "capacity"]), _chains
    ),
    min_size=1,
    max_size=40,
)


def _hashes(path: list[int]) -> list[int]:
    """Block hashes of a prompt: each block's identity is its whole path (a chain)."""
    return [hash(tuple(path[: i + 1])) for i in range(len(path))]


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(1, 30))
def test_run_touch_keeps_the_one_by_one_order(ops: list[tuple[str, list[int]]], cap: int) -> None:
    async def run() -> None:
        index = MemoryIndex(cap)
        ref = _OneByOne(cap)
        for op, path in ops:
            hashes = _hashes(path)
            if op in ("record", "twice"):
                if op == "twice":  # a hash twice in one record
                    hashes = hashes + hashes[: 1 + len(path) % 3]
                await index.record("r", hashes)
                ref.touch(hashes)
            elif op == "forget":  # a tail, or a block in the middle: a gap
                cut = len(hashes) // 2
                await index.forget("r", hashes[cut : cut + 1 + len(path) % 3])
                for h in hashes[cut : cut + 1 + len(path) % 3]:
                    ref.blocks.pop(h, None)
            else:
                new_cap = 1 + len(path) * 2
                await index.set_capacity("r", new_cap)
                ref.capacity = new_cap
                while len(ref.blocks) > ref.capacity:
                    ref.blocks.popitem(last=False)
            cache = index._replicas.get("r")
            assert list(cache.blocks if cache else []) == list(ref.blocks)

    asyncio.run(run())
