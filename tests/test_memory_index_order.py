"""The in-memory index moves a prompt's held run with a C-level loop and leaves a pinned run
in place (router/index/memory.py): its LRU order, and so what it evicts and what it matches,
is exactly that of touching the blocks one by one, including where the held set is not
prefix-closed (forgotten blocks, a chain's tail held without its head)."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index.memory import MemoryIndex, _ReplicaCache


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
        st.sampled_from(["record", "twice", "forget", "capacity", "again", *["system"] * 5]),
        _chains,
    ),
    min_size=1,
    max_size=40,
)


def _hashes(path: list[int]) -> list[int]:
    """Block hashes of a prompt: each block's identity is its whole path (a chain)."""
    return [hash(tuple(path[: i + 1])) for i in range(len(path))]


@settings(max_examples=300, deadline=None)
@given(
    _ops, st.integers(1, 30), st.sampled_from([1, 2, _ReplicaCache.PIN_BLOCKS]), st.integers(1, 5)
)
def test_run_touch_keeps_the_one_by_one_order(
    ops: list[tuple[str, list[int]]], cap: int, pin: int, system: int
) -> None:
    async def run() -> None:
        index = MemoryIndex(cap)
        ref = _OneByOne(cap)
        last: list[int] = [0]
        for i, (op, path) in enumerate(ops):
            if op == "again":  # the last record's first blocks, then others
                path = last[: 1 + len(path) % len(last)] + path
                op = "record"
            elif op == "system":  # a system prompt, then a new turn: a run to pin
                path = [7] * system + [100 + i] + path
                op = "record"
            last = path
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
            assert (cache.order() if cache is not None else []) == list(ref.blocks)

    default = _ReplicaCache.PIN_BLOCKS
    _ReplicaCache.PIN_BLOCKS = pin  # how many held blocks two records in a row pin
    try:
        asyncio.run(run())
    finally:
        _ReplicaCache.PIN_BLOCKS = default


@pytest.mark.parametrize("capacity", [10_000, 700, 60])
def test_a_repeated_system_prompt_is_pinned_and_the_order_kept(capacity: int) -> None:
    """The mix the pinned run is for: one system prompt, a new turn on every request (and
    another tenant's prompt now and then). The run is pinned after two records and stays
    pinned while the index is full; the order is the one-by-one order throughout."""
    rng = random.Random(7)
    system = [rng.getrandbits(64) for _ in range(40)]
    cache = _ReplicaCache(capacity)
    ref = _OneByOne(capacity)
    pinned = 0
    for i in range(60):
        if i % 13 == 12:  # another prompt: unpins, then pins again
            hashes = [rng.getrandbits(64) for _ in range(30)]
        else:
            hashes = system + [rng.getrandbits(64) for _ in range(25)]
        cache.touch(hashes)
        ref.touch(hashes)
        pinned += cache.run == system
        assert cache.order() == list(ref.blocks)
    assert pinned >= 40 or capacity < 65  # below, a record evicts part of the run
    cache.capacity = ref.capacity = 10  # below the run's length: evicts into it
    cache.trim()
    while len(ref.blocks) > ref.capacity:
        ref.blocks.popitem(last=False)
    assert cache.order() == list(ref.blocks) and len(cache) == 10
