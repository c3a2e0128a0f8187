"""vLLM's KV offloading to CPU memory (``OffloadingConnector`` with its CPU backend), as the
simulator needs it: the tier a block evicted from the GPU can still be loaded from.

What is reproduced (vLLM 0.34, the connector's defaults):

* each computed prompt block is copied to the CPU as one chunk (``blocks_per_chunk`` 1,
  ``offload_prompt_only`` true: vllm/v1/kv_offload/base.py:790-792,
  offloading/config.py:121-155); a chunk already there is not stored again;
* a full tier evicts its least recently used chunks first (the LRU policy; a request's
  head is kept over its tail: cpu/policies/lru.py), announced by one ``BlockRemoved`` with
  every evicted hash (cpu/manager.py:352-358), then one ``BlockStored`` per stored chunk
  (cpu/manager.py:418-425) in the connector's placeholder form, without
  ``self_describing_kv_events``: the hash, no parent, no tokens, ``block_size`` 0,
  ``medium`` "CPU" (offloading/events.py:490-520), after the engine's GPU events of the step
  (vllm/v1/core/sched/scheduler.py:2689-2704);
* a request hits the GPU's leading run, then the tier's consecutive chunks after it, up to
  every full block of the prompt (offloading/scheduler.py:904-1125: no ``num_tokens - 1``
  cap for full attention); the loaded tokens count in ``cached_tokens`` (PrefillStats,
  v1/metrics/stats.py:327-340) and in ``vllm:external_prefix_cache_hits``, not in
  ``vllm:prefix_cache_hits``;
* the loaded blocks land in GPU blocks that are cached (and published) as computed ones.

The store is modelled as done when the request is admitted (vLLM: once the copy lands, a step
or so later).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from loadtest.sim.kvcache import external_hash

MEDIUM_CPU = "CPU"


class CpuTier:
    def __init__(self, num_blocks: int, *, events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # head: evicted first
        self.events: list[dict[str, Any]] | None = [] if events else None
        self.evictions = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """Chunks of ``hashes[start:end]`` held consecutively from ``start``."""
        n = 0
        for h in hashes[start:end]:
            if h not in self._lru:
                break
            n += 1
        return n

    def access(self, hashes: Sequence[bytes]) -> None:
        """A request used these chunks (stored or loaded): most recent, its head last."""
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)

    def store(self, hashes: Sequence[bytes]) -> None:
        """Offload a request's prompt blocks (its full blocks, in order)."""
        lru = self._lru
        self.access(hashes)  # the request's own chunks are not evicted for it
        new = [h for h in dict.fromkeys(hashes) if h not in lru]
        new = new[-self.num_blocks :]  # more than fit: the tier keeps the last ones
        evicted = []
        while len(lru) + len(new) > self.num_blocks:
            h, _ = lru.popitem(last=False)
            evicted.append(h)
        self.evictions += len(evicted)
        for h in new:
            lru[h] = None
        self.access(hashes)
        if self.events is None:
            return
        if evicted:
            self.events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [external_hash(h) for h in evicted],
                    "medium": MEDIUM_CPU,
                    "group_idx": 0,
                }
            )
        for h in new:
            self.events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [external_hash(h)],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "medium": MEDIUM_CPU,
                    "lora_name": None,
                    "group_idx": 0,
                }
            )

    def take_events(self) -> list[dict[str, Any]]:
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def cached_hashes(self) -> set[bytes]:
        """Every hash the tier holds now. For tests."""
        return set(self._lru)
