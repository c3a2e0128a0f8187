"""``PrefixIndex`` in Redis as one hash per model: a match is one ``HMGET``, writes are batched.

Key layout (``router/index/map_scripts.py`` has the value formats)::

    {ns}:{<model>}:map               HASH  field = block hash (8 bytes) -> its holders (replica
                                           id, stamp); the replicas' capacity, top stamp and
                                           size under short fields
    {ns}:{<model>}:blocks:<replica>  ZSET  member = block hash, score = stamp: the eviction
                                           order only (read by the flush's trim)

Why: the sorted-set layout (router/index/redis.py) asked one ``ZSCORE`` per probe of each
candidate's binary search inside its match script and ran ~8 commands per record, about 25
commands per request in all (``INFO commandstats``). Here a match is one command for all
candidates (a script running one ``HMGET`` of the prompt's blocks: Redis does O(n) lookups,
then each candidate's run by the binary search ``MemoryIndex`` does), and records, forgets and capacity
changes are queued and sent as one script call per model every ``flush_interval_s`` or
``flush_ops`` operations, whichever comes first: a few commands for the whole batch.

Writes are late by at most one flush interval for other gateways. This gateway's own matches
see its queued writes (the ``_Batch`` overlay: a queued record of a chain holds the prompt's
common prefix with it; a queued forget cuts the run), so one gateway predicts what
``MemoryIndex`` does. ``ResilientIndex`` runs the flushes (``due``, ``flush``) under its circuit
breaker; without it, call ``flush``.

Replica ids are the first 4 bytes of the URL's BLAKE2b digest: two replicas of one model whose
ids collided (about one fleet in 10^7 at 30 replicas) would share blocks; it is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.core.redis_client import Client, aclose
from router.core.redis_client import ping as ping_client
from router.index.keys import ModelKeys
from router.index.map_scripts import DROP, FLUSH, MATCH, script
from router.index.memory import DEFAULT_CAPACITY_BLOCKS

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "prefix-router"
DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_FRESH_FRACTION = 1 / 16
DEFAULT_FLUSH_INTERVAL_S = 0.1
DEFAULT_FLUSH_OPS = 512
# The keys' TTLs are refreshed (and the zsets recounted) by one flush in this many seconds.
TTL_REFRESH_S = 60.0


def replica_id(url: str) -> bytes:
    return hashlib.blake2b(url.encode(), digest_size=4).digest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading blocks two chains share, given ``a[0] == b[0]`` (chained hashes: equal
    at i means equal before i)."""
    n = min(len(a), len(b))
    if a[n - 1] == b[n - 1]:
        return n
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Batch:
    """Queued writes, in order, and what a match reads of them: a replica's records by their
    first block and its forgets, each with its place in the queue."""

    ops: list[tuple[str, str, Sequence[int]]] = field(default_factory=list)
    since: float = 0.0  # time.monotonic() of the first op
    records: dict[tuple[str, int], list[tuple[int, Sequence[int]]]] = field(default_factory=dict)
    forgets: dict[str, list[tuple[int, frozenset[int]]]] = field(default_factory=dict)

    def add(self, kind: str, replica: str, blocks: Sequence[int]) -> None:
        if not self.ops:
            self.since = time.monotonic()
        at = len(self.ops)
        self.ops.append((kind, replica, blocks))
        if kind == "r":
            self.records.setdefault((replica, blocks[0]), []).append((at, blocks))
        elif kind == "f":
            self.forgets.setdefault(replica, []).append((at, frozenset(blocks)))

    def overlay(self, replica: str, prompt: Sequence[int], run: int) -> int:
        records = self.records.get((replica, prompt[0]), ())
        forgets = self.forgets.get(replica)
        if forgets is None:  # the usual case: records only, in any order
            for _, blocks in records:
                run = max(run, common_prefix(prompt, blocks))
            return run
        for _, what in sorted([*records, *forgets], key=lambda x: x[0]):
            if isinstance(what, frozenset):
                run = next((i for i in range(run) if prompt[i] in what), run)
            else:
                run = max(run, common_prefix(prompt, what))
        return run


class RedisMapIndex:
    """``PrefixIndex`` over a Redis client, one map per model (see module doc)."""

    buffered = True  # ResilientIndex runs the flushes

    def __init__(
        self,
        client: Client,
        model: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        owns_client: bool = False,
        refresh_blocks: int | None = None,
        fresh_fraction: float = DEFAULT_FRESH_FRACTION,
        model_of: Callable[[str], str | None] | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        flush_ops: int = DEFAULT_FLUSH_OPS,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if refresh_blocks is not None and refresh_blocks < 1:
            raise ValueError("refresh_blocks must be at least 1 (or None: rewrite every block)")
        self.client = client
        self.keys = ModelKeys(namespace, model, model_of)
        self.default_capacity = max(1, default_capacity)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.owns_client = owns_client
        self.refresh_blocks = refresh_blocks
        self.fresh_fraction = fresh_fraction
        self.flush_interval_s = flush_interval_s
        self.flush_ops = max(1, flush_ops)
        self._flush = client.register_script(script(FLUSH))
        self._drop = client.register_script(script(DROP))
        self._match = client.register_script(script(MATCH))
        self._capacity: dict[str, int] = {}  # capacities this gateway set (stored back)
        self._sizes: dict[str, int] = {}
        self._ids: dict[str, bytes] = {}
        self._touched: dict[str, tuple[float, set[str]]] = {}  # map key -> (when, replicas)
        self._pending = _Batch()
        self._flushing: _Batch | None = None
        self._wake = asyncio.Event()  # an op is queued
        self._full = asyncio.Event()  # flush now: flush_ops queued, or a capacity changed
        self._flush_lock = asyncio.Lock()  # one flush at a time: the overlay reads one batch
        self.records = 0
        self.written_blocks = 0  # members the flushes (re)wrote
        self.flushes = 0

    # keys ---------------------------------------------------------------------------------

    def prefix_of(self, replica: str) -> str:
        return self.keys.prefix_of(replica)

    def map_key(self, replica: str) -> str:
        return f"{self.prefix_of(replica)}map"

    def blocks_key(self, replica: str) -> str:
        return f"{self.prefix_of(replica)}blocks:{replica}"

    def rid(self, replica: str) -> bytes:
        rid = self._ids.get(replica)
        if rid is None:
            rid = self._ids[replica] = replica_id(replica)
            twins = [r for r, i in self._ids.items() if i == rid and r != replica]
            if twins:
                log.warning("replicas %s and %s share an index id", replica, twins[0])
        return rid

    # PrefixIndex --------------------------------------------------------------------------

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        if not replicas:
            return {}
        n = len(block_hashes)
        if not n:
            return dict.fromkeys(replicas, 0)
        blob = struct.pack(f"<{n}Q", *block_hashes)
        by_key: dict[str, list[str]] = {}
        for r in replicas:
            by_key.setdefault(self.map_key(r), []).append(r)
        groups = list(by_key.items())

        async def ask(key: str, group: list[str]) -> list[int]:
            return await self._match(keys=[key], args=[blob, *(self.rid(r) for r in group)])

        if len(groups) == 1:  # the rule: a request's candidates serve one model
            answers = [await ask(*groups[0])]
        else:
            answers = await asyncio.gather(*(ask(k, g) for k, g in groups))
        runs = {
            r: int(c)
            for (_, g), a in zip(groups, answers, strict=True)
            for r, c in zip(g, a, strict=True)
        }
        out = {}
        for r in replicas:
            run = runs[r]
            for batch in (self._flushing, self._pending):
                if batch is not None:
                    run = batch.overlay(r, block_hashes, run)
            out[r] = run
        return out

    def _queue(self, kind: str, replica: str, blocks: Sequence[int]) -> None:
        self._pending.add(kind, replica, blocks)
        self._wake.set()
        if len(self._pending.ops) >= self.flush_ops or kind == "c":
            self._full.set()

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.records += 1
            self._queue("r", replica, tuple(block_hashes))

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self._queue("f", replica, tuple(block_hashes))

    async def set_capacity(self, replica: str, blocks: int) -> None:
        self._capacity[replica] = max(1, int(blocks))
        self._queue("c", replica, ())

    async def drop_replica(self, replica: str) -> None:
        self._capacity.pop(replica, None)
        self._sizes.pop(replica, None)
        kept = [op for op in self._pending.ops if op[1] != replica]
        if len(kept) != len(self._pending.ops):
            self._pending = _Batch()
            for op in kept:
                self._pending.add(*op)
        key = self.map_key(replica)
        self._touched.get(key, (0.0, set()))[1].discard(replica)
        await self._drop(keys=[key, self.blocks_key(replica)], args=[self.rid(replica)])

    def size(self, replica: str) -> int:
        """Blocks modelled for ``replica`` as of this gateway's last flush that wrote to it
        (other gateways' writes since are not counted): approximate, for metrics."""
        return self._sizes.get(replica, 0)

    # flushing -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Writes queued or being flushed."""
        return len(self._pending.ops) + (len(self._flushing.ops) if self._flushing else 0)

    async def due(self) -> None:
        """Return once a flush is due: ``flush_ops`` writes queued (or a capacity changed), or
        ``flush_interval_s`` after the first queued one."""
        while not self._pending.ops:
            self._wake.clear()
            await self._wake.wait()
        wait = self._pending.since + self.flush_interval_s - time.monotonic()
        if wait > 0 and not self._full.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._full.wait(), wait)

    def discard(self) -> int:
        """Drop the queued writes (Redis is down: they are skipped, as unbatched ones were)."""
        n = len(self._pending.ops)
        self._pending = _Batch()
        self._full.clear()
        return n

    async def flush(self) -> None:
        """Send the queued writes: one script call per model. Raises what Redis raised (the
        batch is then lost, as a failed write was)."""
        async with self._flush_lock:
            await self._flush_batch()

    async def _flush_batch(self) -> None:
        batch, self._pending = self._pending, _Batch()
        self._full.clear()
        if not batch.ops:
            return
        self._flushing = batch
        try:
            groups: dict[str, list[tuple[str, str, Sequence[int]]]] = {}
            for op in batch.ops:
                groups.setdefault(self.map_key(op[1]), []).append(op)
            if len(groups) == 1:
                ((key, ops),) = groups.items()
                await self._flush_model(key, ops)
            else:
                await asyncio.gather(*(self._flush_model(k, ops) for k, ops in groups.items()))
            self.flushes += 1
        finally:
            self._flushing = None

    async def _flush_model(self, key: str, ops: list[tuple[str, str, Sequence[int]]]) -> None:
        order: dict[str, int] = {}
        for _, replica, _ in ops:
            order.setdefault(replica, len(order) + 1)
        now = time.monotonic()
        when, seen = self._touched.get(key, (0.0, set()))
        if now - when >= TTL_REFRESH_S:  # every key of the batch, and a recount
            touch, self._touched[key] = True, (now, set(order))
        else:  # a replica's first flush here gives its new zset a TTL
            touch = not seen.issuperset(order)
            if touch:
                self._touched[key] = (when, seen | set(order))
        args: list[Any] = [
            self.ttl_ms,
            "1" if touch else "0",
            self.refresh_blocks or 0,
            repr(self.fresh_fraction),
        ]
        for replica in order:
            known = self._capacity.get(replica)
            args += [
                self.rid(replica),
                known if known is not None else self.default_capacity,
                "1" if known is not None else "0",
            ]
        for kind, replica, blocks in ops:
            blob = struct.pack(f"<{len(blocks)}Q", *blocks) if blocks else b""
            args += [kind, order[replica], blob]
        keys = [key] + [self.blocks_key(r) for r in order]
        written, *cards = await self._flush(keys=keys, args=args)
        self.written_blocks += int(written)
        for replica, card in zip(order, cards, strict=True):
            self._sizes[replica] = int(card)

    async def ping(self) -> bool:
        """One round trip; raises when Redis is unreachable (used by ``ResilientIndex``)."""
        return await ping_client(self.client)

    async def close(self) -> None:
        if self.owns_client:
            await aclose(self.client)
