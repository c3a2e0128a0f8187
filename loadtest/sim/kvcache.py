"""vLLM's prefix cache, reimplemented as the ground truth the router is tested against.

Deliberately independent of ``router.core.blocks``: the router's fast XXH3 chain must make the same
sharing decisions as this, and a test can only show that if the two are written separately.

What is reproduced (vLLM v1, ``vllm/v1/core/kv_cache_utils.py`` and ``block_pool.py``):

* block hash = ``sha256(pickle((parent_hash, tuple(block_token_ids), extra_keys_or_None)))``,
  the root parent being ``sha256(pickle("vllm-none-hash"))``;
* extra keys: ``("lora", name)`` on every block of an adapter request, ``("cache_salt", salt)``
  on block 0 only (the chain carries it to every later block);
* only full blocks are hashed; a hash may be held by several physical blocks at once;
* lookup: the longest run from block 0, stopping at the first miss;
* a free queue in LRU order: freed blocks go to the tail (callers pass them tail-first, as vLLM
  frees ``reversed(request_blocks)``), allocation pops the head and drops that block's hash,
  a cache hit on a free block takes it out of the queue;
* KV cache events (``vllm/v1/core/block_pool.py``), when enabled: one ``BlockStored`` per
  ``cache_blocks`` call (the blocks one request filled in one step, their parent, token ids,
  LoRA and per-block untagged extra keys), one ``BlockRemoved`` per hash a block drops on
  eviction, ``AllBlocksCleared`` when a reset finds every block free (vLLM refuses a reset
  otherwise; this pool forgets the free blocks and reports each as removed). Events are
  plain dicts in vLLM's field order, hashes as vLLM's default int form (the digest's last 8
  bytes, big-endian); ``loadtest.sim.kv_events`` puts them on the wire.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

NONE_HASH: bytes = hashlib.sha256(
    pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)
).digest()


MEDIUM_GPU = "GPU"


def external_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``."""
    return int.from_bytes(block_hash, "big") & 0xFFFFFFFFFFFFFFFF


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    """One block's hash, vLLM's ``sha256`` algorithm (pickle + SHA-256)."""
    data = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


def extra_keys(
    block_index: int, *, lora: str | None = None, cache_salt: str | None = None
) -> tuple | None:
    keys: list[tuple[str, str]] = []
    if lora:
        keys.append(("lora", lora))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def extend_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora: str | None = None,
    cache_salt: str | None = None,
    upto_blocks: int | None = None,
) -> list[bytes]:
    """Append to ``hashes`` the hashes of the next full blocks of ``token_ids`` (all of them,
    or up to ``upto_blocks`` in total). Returns ``hashes``."""
    n = len(token_ids) // block_size
    if upto_blocks is not None:
        n = min(n, upto_blocks)
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(len(hashes), n):
        parent = hash_block(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            extra_keys(i, lora=lora, cache_salt=cache_salt),
        )
        hashes.append(parent)
    return hashes


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``."""
    return extend_hashes([], token_ids, block_size, lora=lora, cache_salt=cache_salt)


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """A fixed pool of KV blocks with vLLM's caching and eviction rules."""

    def __init__(self, num_blocks: int, *, events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        # KV cache events waiting to be taken (``take_events``), None when disabled; and,
        # with events on, for tests, what each cached hash was made of: (parent, token ids,
        # lora, salt).
        self.events: list[dict[str, Any]] | None = [] if events else None
        self.lineage: dict[bytes, tuple[bytes | None, tuple[int, ...], str | None, str | None]] = {}
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free queue, head = least recently used. OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, dict[int, Block]] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks currently holding a hash (in use or free)."""
        return sum(len(v) for v in self._cached.values())

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def free_order(self) -> list[int]:
        """Block ids of the free queue, head (next to evict) first. For tests."""
        return list(self._free)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[Block]:
        """The longest cached run of ``hashes`` from block 0, at most ``max_blocks`` long."""
        hit: list[Block] = []
        cached = self._cached
        for h in hashes[:max_blocks]:
            holders = cached.get(h)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache-hit blocks (a free one leaves the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def _uncache(self, b: Block) -> bool:
        """Drop ``b``'s hash from the cache map; True if it had one."""
        if b.block_hash is None:
            return False
        holders = self._cached.get(b.block_hash)
        if holders is not None:
            holders.pop(b.block_id, None)
            if not holders:
                del self._cached[b.block_hash]
                self.lineage.pop(b.block_hash, None)
        if self.events is not None:
            self.events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [external_hash(b.block_hash)],
                    "medium": MEDIUM_GPU,
                    "group_idx": 0,
                }
            )
        b.block_hash = None
        return True

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            if self._uncache(b):
                self.evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Register a (newly) full block under its hash."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        first_block: int,
        lora: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """The blocks ``hashes`` (block indices ``first_block``.. of one request, made of
        ``token_ids``) were just cached: queue vLLM's ``BlockStored`` for them."""
        if not hashes or self.events is None:
            return
        prev = parent
        for i, h in enumerate(hashes):
            if h not in self.lineage:
                toks = tuple(token_ids[i * block_size : (i + 1) * block_size])
                salt = cache_salt if first_block + i == 0 else None
                self.lineage[h] = (prev, toks, lora, salt)
            prev = h
        # vLLM publishes extra keys untagged: the LoRA name on every block, the salt on block 0.
        per_block: list[tuple[str, ...] | None] = []
        for i in range(len(hashes)):
            keys = [k for k in (lora, cache_salt if first_block + i == 0 else None) if k]
            per_block.append(tuple(keys) if keys else None)
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in hashes],
            "parent_block_hash": None if parent is None else external_hash(parent),
            "token_ids": list(token_ids),
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": lora,
        }
        if any(k is not None for k in per_block):  # omit_defaults: None is left out
            event["extra_keys"] = per_block
        event["group_idx"] = 0
        self.events.append(event)

    def take_events(self) -> list[dict[str, Any]]:
        """The queued events, oldest first (the queue is emptied)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def cached_hashes(self) -> set[bytes]:
        """Every hash some block holds now. For tests."""
        return set(self._cached)

    def free(self, blocks_tail_first: Iterable[Block]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's tail in
        the order given (pass ``reversed(request_blocks)`` so a request's tail is evicted
        first)."""
        for b in blocks_tail_first:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def reset(self) -> int:
        """Forget the hashes of every free block (in-use blocks keep theirs). Returns how many
        hashes were dropped. With every block free this is vLLM's ``reset_prefix_cache``
        and the event is ``AllBlocksCleared``; otherwise each dropped hash is reported."""
        everything = len(self._free) == self.num_blocks
        events, self.events = self.events, (None if everything else self.events)
        dropped = 0
        for b in self._free.values():
            if self._uncache(b):
                dropped += 1
        self.events = events
        if everything and events is not None:
            events.append({"type": "AllBlocksCleared"})
        return dropped
