"""``PrefixIndex`` in Redis, shared by every gateway in front of the same fleet.

Key layout (``ns`` is the namespace, default ``prefix-router``; ``model`` is the base model the
replica serves, hash-tagged so that every key of one model, and so every key a script touches,
lives in one Redis Cluster slot)::

    {ns}:{<model>}:blocks:<replica>   ZSET   member = block hash, score = recency (higher =
                                             more recent); at most the replica's capacity
                                             members; PEXPIRE ttl, refreshed on every record
    {ns}:{<model>}:cap:<replica>      STRING the replica's capacity in blocks (set_capacity);
                                             PEXPIRE ttl, refreshed on every record

Each model's index has its own keys: a replica's keys carry the model it reports serving
(``model_of``), so every gateway keys model M's blocks alike whichever model it saw first; a
replica whose model is not known yet uses the index's default ``model``. A match over replicas
of several models is one script call per model.

Members are the 64-bit hash as 8 little-endian bytes (``encoding="binary"``, the default) or
as its decimal string (``encoding="decimal"``); binary is ~2.5x smaller on the wire and in
Redis and lets a whole prompt travel as one 8*n-byte argument (see the README section "Fleet mode" for figures).

Recency: a record gives its blocks the scores ``top+1 .. top+n`` where ``top`` is the key's
current highest score, last block lowest, so block 0 is the most recent (exactly the order
``MemoryIndex`` keeps). Scores are per key, so no shared clock is needed and gateways with
skewed clocks agree; the LRU trim is ``ZREMRANGEBYRANK key 0 -(cap+1)``.

Bounded records (``refresh_blocks=B``, fleet mode): rewriting every block of a prompt on every
record saturates Redis with agentic prompts of thousands of blocks, so a record writes only
the blocks new to the replica plus at most B old ones. Recency is kept per chain by
*generations*: a chain whose head (block 0) scores g is up to date when block i scores g - i.
A record finds the held run k and, if the head is still among the most recent
``fresh_fraction`` of the capacity, keeps g and refreshes the next B blocks that do not follow
it yet (the first f blocks do: a binary search, since refreshes always extend that prefix);
otherwise it starts a new generation above ``top`` with the first B blocks. New blocks follow
g when the chain has caught up, else they go just below their parent. Every score is at most
its parent's, so a chain's held set stays prefix-closed under the LRU trim and ``match``'s
binary search stays exact. The model's error is in recency only, and bounded: a hot chain's
head is never more than ``fresh_fraction`` x capacity ranks from where exact LRU puts it, and
its tail catches up B blocks per use. A tail trimmed before it caught up is forgotten earlier
than vLLM would evict it: a shorter predicted match (a missed affinity, corrected by the
reported cached tokens), written again as new blocks by the next record. Cost per record:
O(log n) reads, at most B + (new blocks) members written, the trim.

Match: one ``EVALSHA`` for all candidate replicas. Because block i's hash chains over blocks
0..i-1 and every record touches a prompt's blocks tail first, a block is never more recent
than its ancestors, so LRU trimming evicts descendants first and "holds block i" implies
"holds blocks 0..i-1". The script therefore finds each replica's leading run by binary search
(probe block 0, then the last block, then bisect): O(log n) ``ZSCORE`` per replica instead of
n. The assumption can break only through ``forget`` of a middle block (or a TTL'd key being
rebuilt partially): a hole in the middle of a run can then make the search report a longer
(or shorter) run than a linear scan would. That is a misprediction, not a correctness bug:
the request still succeeds on whatever replica it lands, and the response's ``cached_tokens``
tells the gateway the real hit, which it feeds back through ``forget``/``record`` so the
index converges.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

from router.core.redis_client import Client, aclose, make_client
from router.core.redis_client import ping as ping_client
from router.index.keys import ModelKeys, key_prefix, model_tag
from router.index.memory import DEFAULT_CAPACITY_BLOCKS

__all__ = ["RedisIndex", "key_prefix", "make_client", "model_tag"]

DEFAULT_NAMESPACE = "prefix-router"
DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_REFRESH_BLOCKS = 64  # fleet mode's budget (config redis_refresh_blocks)
DEFAULT_FRESH_FRACTION = 1 / 16

Encoding = Literal["binary", "decimal"]

# Redis's Lua caps unpack() by its C stack (LUAI_MAXCSTACK = 8000); stay well below it.
_CHUNK = 1000

# Per-encoding preamble: defines n (number of hashes, starting at ARGV[first]) and m(i), the
# member for 1-based block i.
_MEMBERS = {
    "binary": """
local blob = ARGV[{first}]
local n = #blob / 8
local function m(i) return string.sub(blob, 8 * i - 7, 8 * i) end
""",
    "decimal": """
local n = #ARGV - {first} + 1
local function m(i) return ARGV[{first} + i - 1] end
""",
}

# KEYS: one blocks zset per candidate replica. ARGV: the prompt's block hashes.
# Returns, per key, the number of leading blocks held (binary search; see module doc).
_MATCH = """
local out = {{}}
for k = 1, #KEYS do
  local key = KEYS[k]
  local got = 0
  if n > 0 and redis.call('ZSCORE', key, m(1)) then
    if redis.call('ZSCORE', key, m(n)) then
      got = n
    else
      -- blocks 1..lo are held, block hi+1 is not
      local lo, hi = 1, n - 1
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        if redis.call('ZSCORE', key, m(mid)) then lo = mid else hi = mid - 1 end
      end
      got = lo
    end
  end
  out[k] = got
end
return out
"""

# The capacity both record scripts trim to (``ttl`` set before it).
_CAPACITY = """
local cap = tonumber(redis.call('GET', KEYS[2]))
if cap then
  redis.call('PEXPIRE', KEYS[2], ttl)
else
  cap = tonumber(ARGV[1])
  if ARGV[2] == '1' then redis.call('SET', KEYS[2], ARGV[1], 'PX', ttl) end
end
"""

# KEYS[1] blocks zset, KEYS[2] capacity. ARGV[1] capacity to use if none stored, ARGV[2] '1'
# if that capacity is known (set_capacity'd by this gateway: store it back, e.g. after a Redis
# restart), ARGV[3] ttl ms, then the hashes. Returns the key's cardinality after the trim.

_RECORD = (
    """
local ttl = ARGV[3]
"""
    + _CAPACITY
    + """local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local base = tonumber(top[2]) or 0
local args, j = {{}}, 0
for i = n, 1, -1 do
  args[j + 1] = base + n - i + 1
  args[j + 2] = m(i)
  j = j + 2
  if j >= {chunk} then
    redis.call('ZADD', KEYS[1], unpack(args, 1, j))
    j = 0
  end
end
if j > 0 then redis.call('ZADD', KEYS[1], unpack(args, 1, j)) end
local card = redis.call('ZCARD', KEYS[1])
if card > cap then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, card - cap - 1)
  card = cap
end
redis.call('PEXPIRE', KEYS[1], ttl)
return card
"""
)

# Write only what changed (``refresh_blocks`` set; see "Bounded records" in the module doc).
# KEYS and ARGV[1..3] as _RECORD, ARGV[4] the refresh budget B, ARGV[5] the head's freshness
# bound as a fraction of the capacity, then the hashes. Returns {cardinality, members written}.
_RECORD_CHANGED = (
    """
local ttl, budget = ARGV[3], tonumber(ARGV[4])
"""
    + _CAPACITY
    + """local key = KEYS[1]
local function score(i) return tonumber(redis.call('ZSCORE', key, m(i))) end
-- k: the leading run held (binary search, as in match)
local k = 0
local s1 = score(1)
if s1 then
  if score(n) then
    k = n
  else
    local lo, hi = 1, n - 1
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if score(mid) then lo = mid else hi = mid - 1 end
    end
    k = lo
  end
end
local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local base = tonumber(top[2]) or 0
local args, j, written = {{}}, 0, 0
local function add(sc, i)
  args[j + 1] = sc
  args[j + 2] = m(i)
  j = j + 2
  written = written + 1
  if j >= {chunk} then
    redis.call('ZADD', key, unpack(args, 1, j))
    j = 0
  end
end
-- A generation g: block i of a chain whose head (block 1) scores g should score g - (i - 1).
local g, f = base + n, 0
if k > 0 then
  local fresh = math.max(budget, math.floor(cap * tonumber(ARGV[5])))
  if redis.call('ZREVRANK', key, m(1)) < fresh then
    g = s1  -- the head is recent enough: keep its generation; f blocks already follow it
    f = 1
    if score(k) >= g - (k - 1) then
      f = k
    else
      local lo, hi = 1, k - 1  -- blocks 1..lo follow g, block hi+1 does not
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        local sm = score(mid)
        if sm and sm >= g - (mid - 1) then lo = mid else hi = mid - 1 end
      end
      f = lo
    end
  end
end
local upto = math.min(k, f + budget)
for i = upto, f + 1, -1 do add(g - (i - 1), i) end
if upto == k then
  for i = n, k + 1, -1 do add(g - (i - 1), i) end
else  -- the chain has not caught up with g yet: new blocks go just below their parent
  local sk = score(k)
  for i = n, k + 1, -1 do add(sk - (i - k), i) end
end
if j > 0 then redis.call('ZADD', key, unpack(args, 1, j)) end
local card = redis.call('ZCARD', key)
if card > cap then
  redis.call('ZREMRANGEBYRANK', key, 0, card - cap - 1)
  card = cap
end
redis.call('PEXPIRE', key, ttl)
return {{card, written}}
"""
)

# KEYS[1] blocks zset. ARGV: the hashes to remove. Returns the cardinality left.
_FORGET = """
local args, j = {{}}, 0
for i = 1, n do
  j = j + 1
  args[j] = m(i)
  if j >= {chunk} then
    redis.call('ZREM', KEYS[1], unpack(args, 1, j))
    j = 0
  end
end
if j > 0 then redis.call('ZREM', KEYS[1], unpack(args, 1, j)) end
return redis.call('ZCARD', KEYS[1])
"""

# KEYS[1] blocks zset, KEYS[2] capacity. ARGV[1] capacity, ARGV[2] ttl ms.
# Stores the capacity and trims to it; returns the cardinality left.
_SET_CAPACITY = """
local cap = tonumber(ARGV[1])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local card = redis.call('ZCARD', KEYS[1])
if card > cap then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, card - cap - 1)
  card = cap
end
return card
"""


def _script(body: str, encoding: Encoding, first: int) -> str:
    return _MEMBERS[encoding].format(first=first) + body.format(chunk=_CHUNK)


class RedisIndex:
    """``PrefixIndex`` over a Redis client (router/core/redis_client.py: one server, a Cluster or
    a Sentinel's master). Every call touches one model's keys, so one Cluster slot; every
    method is one round trip (after the scripts are cached server-side)."""

    def __init__(
        self,
        client: Client,
        model: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        encoding: Encoding = "binary",
        owns_client: bool = False,
        refresh_blocks: int | None = None,
        fresh_fraction: float = DEFAULT_FRESH_FRACTION,
        model_of: Callable[[str], str | None] | None = None,
    ) -> None:
        if encoding not in _MEMBERS:
            raise ValueError(f"encoding must be 'binary' or 'decimal', not {encoding!r}")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.client = client
        self.model = model
        self.namespace = namespace
        self.keys = ModelKeys(namespace, model, model_of)
        self.prefix = self.keys.prefix  # a replica whose model is unknown
        self.default_capacity = max(1, default_capacity)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.encoding: Encoding = encoding
        self.owns_client = owns_client
        # Capacities this gateway set: passed to the record script so a Redis that lost them
        # (restart) gets them back on the next record.
        self._capacity: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._match = client.register_script(_script(_MATCH, encoding, 1))
        self._record = client.register_script(_script(_RECORD, encoding, 4))
        self._forget = client.register_script(_script(_FORGET, encoding, 1))
        self._set_capacity = client.register_script(_SET_CAPACITY)
        # Bounded records: at most ``refresh_blocks`` old blocks refreshed per record.
        if refresh_blocks is not None and refresh_blocks < 1:
            raise ValueError("refresh_blocks must be at least 1 (or None: rewrite every block)")
        self.refresh_blocks = refresh_blocks
        self.fresh_fraction = fresh_fraction
        self._record_changed = client.register_script(_script(_RECORD_CHANGED, encoding, 6))
        self.records = 0
        self.written_blocks = 0  # members the record scripts (re)wrote

    @classmethod
    def from_url(cls, url: str, model: str, **kwargs: Any) -> RedisIndex:
        """An index owning its own client (closed by ``close``); see ``make_client``."""
        client_kwargs = {
            k: kwargs.pop(k)
            for k in ("socket_timeout", "connect_timeout", "max_connections")
            if k in kwargs
        }
        return cls(make_client(url, **client_kwargs), model, owns_client=True, **kwargs)

    # keys -------------------------------------------------------------------------------

    def prefix_of(self, replica: str) -> str:
        """The key prefix of ``replica``'s model (``ModelKeys``)."""
        return self.keys.prefix_of(replica)

    def blocks_key(self, replica: str) -> str:
        return f"{self.prefix_of(replica)}blocks:{replica}"

    def capacity_key(self, replica: str) -> str:
        return f"{self.prefix_of(replica)}cap:{replica}"

    def _members(self, block_hashes: Sequence[int]) -> list[bytes | str]:
        if self.encoding == "binary":
            return [struct.pack(f"<{len(block_hashes)}Q", *block_hashes)]
        return [str(h) for h in block_hashes]

    # PrefixIndex --------------------------------------------------------------------------

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        if not replicas:
            return {}
        if not block_hashes:
            return dict.fromkeys(replicas, 0)
        members = self._members(block_hashes)
        by_model: dict[str, list[str]] = {}
        for r in replicas:
            by_model.setdefault(self.prefix_of(r), []).append(r)
        if len(by_model) == 1:  # the rule: a request's candidates serve one model
            keys = [self.blocks_key(r) for r in replicas]
            counts = await self._match(keys=keys, args=members)
            return {r: int(c) for r, c in zip(replicas, counts, strict=True)}
        groups = list(by_model.values())
        answers = await asyncio.gather(
            *(self._match(keys=[self.blocks_key(r) for r in g], args=members) for g in groups)
        )
        found = {
            r: int(c)
            for g, a in zip(groups, answers, strict=True)
            for r, c in zip(g, a, strict=True)
        }
        return {r: found[r] for r in replicas}

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        known = self._capacity.get(replica)
        cap = known if known is not None else self.default_capacity
        args: list[Any] = [cap, 1 if known is not None else 0, self.ttl_ms]
        keys = [self.blocks_key(replica), self.capacity_key(replica)]
        self.records += 1
        if self.refresh_blocks is None:
            card = await self._record(keys=keys, args=args + self._members(block_hashes))
            self.written_blocks += len(block_hashes)
        else:
            args += [self.refresh_blocks, repr(self.fresh_fraction)]
            card, written = await self._record_changed(
                keys=keys, args=args + self._members(block_hashes)
            )
            self.written_blocks += int(written)
        self._sizes[replica] = int(card)

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        card = await self._forget(keys=[self.blocks_key(replica)], args=self._members(block_hashes))
        self._sizes[replica] = int(card)

    async def set_capacity(self, replica: str, blocks: int) -> None:
        blocks = max(1, int(blocks))
        self._capacity[replica] = blocks
        card = await self._set_capacity(
            keys=[self.blocks_key(replica), self.capacity_key(replica)], args=[blocks, self.ttl_ms]
        )
        self._sizes[replica] = int(card)

    async def drop_replica(self, replica: str) -> None:
        self._capacity.pop(replica, None)
        self._sizes.pop(replica, None)
        await self.client.delete(self.blocks_key(replica), self.capacity_key(replica))

    def size(self, replica: str) -> int:
        """Blocks modelled for ``replica`` as of this gateway's last write to it (other
        gateways' records since then are not counted): approximate, for metrics."""
        return self._sizes.get(replica, 0)

    async def ping(self) -> bool:
        """One round trip; raises when Redis is unreachable (used by ``ResilientIndex``)."""
        return await ping_client(self.client)

    async def close(self) -> None:
        if self.owns_client:
            await aclose(self.client)
