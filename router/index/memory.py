"""The default index: per-replica LRU sets of block hashes in this process's memory."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat

DEFAULT_CAPACITY_BLOCKS = 65_536


class _ReplicaCache:
    """One replica's blocks in least-recently-used order; bounded by ``capacity``.

    The order is ``blocks`` (oldest first) followed by the *pinned run* ``run`` read
    backwards (``run[0]``, block 0 of a prompt, most recent). The pinned run is a leading
    run of blocks that the replica's prompts keep repeating (a system prompt): a prompt
    that starts with it leaves it where it is, the most recent, and only the blocks after
    it are moved or inserted in ``blocks``, before it. That is exactly the order touching
    every block one by one gives (tests/test_memory_index_order.py), for a fraction of the
    work: a record of a 6,100-token prompt whose first half repeats moved ~190 blocks one by
    one. A run is pinned when two records in a row hold the same leading run (of at least
    ``PIN_BLOCKS``); anything else unpins it first (its blocks go back to ``blocks``, in
    order), so a replica whose prompts alternate costs what it did without pinning."""

    __slots__ = ("_last_held", "blocks", "capacity", "run", "run_set")

    PIN_BLOCKS = 16

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.run: list[int] = []  # the pinned run, block 0 first; none of it in ``blocks``
        self.run_set: frozenset[int] = frozenset()
        self._last_held: int | None = None  # the last held block of the previous record

    def __len__(self) -> int:
        return len(self.blocks) + len(self.run)

    def order(self) -> list[int]:
        """Every block, least recently used first."""
        return [*self.blocks, *reversed(self.run)]

    def leading_match(self, block_hashes: Sequence[int]) -> int:
        """The longest run of held blocks from block 0 (vLLM stops at the first miss too).

        A binary search, exact because the held set of a chain is prefix-closed: ``touch``
        refreshes every block of a prompt with block 0 most recent, so LRU trimming drops a
        chain's tail before its head, and ``forget`` is given tails. O(log n) per replica
        instead of one lookup per block."""
        blocks, run = self.blocks, self.run_set
        n = len(block_hashes)
        if n == 0:
            return 0
        h = block_hashes[0]
        if h not in run and h not in blocks:
            return 0
        h = block_hashes[n - 1]
        if h in run or h in blocks:
            return n
        lo, hi = 1, n - 1  # block lo-1 is held, block hi is not
        while lo < hi:
            mid = (lo + hi) // 2
            h = block_hashes[mid]
            if h in run or h in blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def touch(self, block_hashes: Sequence[int]) -> None:
        # Last block first, so block 0 ends up most recent: trimming then drops a prompt's
        # tail before its head, as vLLM's free queue does (a freed request's blocks are
        # appended tail-first), and the leading run the index reports stays contiguous.
        # The held run is found first: a KeyError per new block cost ~1.5 us, a third of
        # a record's time on a prompt with a new turn.
        if type(block_hashes) is not list:  # compared with the pinned run (a list)
            block_hashes = list(block_hashes)
        held = self.leading_match(block_hashes)
        run = self.run
        k = len(run)
        if k and held >= k and block_hashes[:k] == run:
            rest = block_hashes[k:]
            if self.run_set.isdisjoint(rest):  # else a block of the run is repeated
                self._touch_blocks(rest, held - k)
                self.trim()
                return
        if k:
            self.unpin()
        self._touch_blocks(block_hashes, held)
        last = block_hashes[held - 1] if held else None
        if last is not None and last == self._last_held and held >= self.PIN_BLOCKS:
            self._pin(block_hashes, held)
        self._last_held = last
        self.trim()

    def _touch_blocks(self, block_hashes: Sequence[int], held: int) -> None:
        """Touch ``block_hashes`` in ``blocks`` (none of them in the pinned run), its first
        ``held`` held there (as far as the binary search saw)."""
        blocks = self.blocks
        new = block_hashes[held:]
        if new:
            # Inserted without a lookup first. A block held already (the held set is not
            # prefix-closed) or repeated is not moved by an insert: then the length says
            # so, and every new block is moved to the end in the same order, which is
            # what inserting or moving them one by one gives.
            before = len(blocks)
            for h in reversed(new):
                blocks[h] = None
            if len(blocks) != before + len(new):
                for h in reversed(new):
                    blocks.move_to_end(h)
        # The held run is moved by a C-level loop (~15% fewer instructions than a Python
        # one); a block missing from it (a gap the binary search did not see) raises
        # KeyError, is inserted where it stands, and the loop resumes after it.
        if held:
            run = iter(block_hashes[held - 1 :: -1])
            while True:
                try:
                    deque(map(blocks.move_to_end, run), maxlen=0)
                    break
                except KeyError as e:
                    blocks[e.args[0]] = None

    def _pin(self, block_hashes: Sequence[int], held: int) -> None:
        """Pin the prompt's first ``held`` blocks, just touched: the last ``held`` of
        ``blocks`` (when the prompt repeats no block)."""
        if len(set(block_hashes)) != len(block_hashes):
            return
        run = list(block_hashes[:held])
        deque(map(self.blocks.pop, run), maxlen=0)
        self.run, self.run_set = run, frozenset(run)

    def unpin(self) -> None:
        """Put the pinned run back at the end of ``blocks``, in its order."""
        if self.run:
            self.blocks.update(zip(reversed(self.run), repeat(None)))
            self.run, self.run_set = [], frozenset()

    def trim(self) -> None:
        blocks = self.blocks
        excess = len(blocks) + len(self.run) - self.capacity
        if excess <= 0:
            return
        if excess > len(blocks):  # the pinned run is the most recent: it goes last
            self.unpin()
        for _ in range(excess):
            blocks.popitem(last=False)

    def forget(self, block_hashes: Sequence[int]) -> None:
        self.unpin()
        for h in block_hashes:
            self.blocks.pop(h, None)


class MemoryIndex:
    """``PrefixIndex`` in memory. Memory is bounded by the sum of replica capacities."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.default_capacity = default_capacity
        self._replicas: dict[str, _ReplicaCache] = {}

    def _cache(self, replica: str) -> _ReplicaCache:
        cache = self._replicas.get(replica)
        if cache is None:
            cache = self._replicas[replica] = _ReplicaCache(self.default_capacity)
        return cache

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        out = {}
        for r in replicas:
            cache = self._replicas.get(r)
            out[r] = cache.leading_match(block_hashes) if cache is not None else 0
        return out

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self._cache(replica).touch(block_hashes)

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        """Drop blocks; give a chain's tail (from the first block no longer held) so the held
        set stays prefix-closed."""
        cache = self._replicas.get(replica)
        if cache is not None:
            cache.forget(block_hashes)

    async def set_capacity(self, replica: str, blocks: int) -> None:
        cache = self._cache(replica)
        cache.capacity = max(1, blocks)
        cache.trim()

    async def drop_replica(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def size(self, replica: str) -> int:
        cache = self._replicas.get(replica)
        return len(cache) if cache is not None else 0

    def blocks(self, replica: str) -> set[int]:
        """Every block hash modelled for ``replica`` (diagnostics and tests)."""
        cache = self._replicas.get(replica)
        return set(cache.order()) if cache is not None else set()

    async def close(self) -> None:
        self._replicas.clear()
