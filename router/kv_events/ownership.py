"""Fleet mode: which gateway writes each replica's KV events into the shared index.

Every gateway subscribes to every replica's events and keeps its own exact view (its local
fallback index, the vLLM -> gateway hash map); only one, the stream's *owner*, writes them to
Redis. Without this N gateways multiply every event's writes by N.

Ownership is a Redis lease per replica stream, ``{ns}:{fleet}:kvlease:<replica>`` = the
owner's gateway id, ``SET NX PX ttl``, renewed on every tick (``ttl`` = 5 ticks, at least 2 s). A free lease
is claimed first by the gateway that rendezvous hashing prefers among the live gateways it
knows (so streams spread over the gateways), and by any gateway once it has seen the lease
free for a whole tick (so a stream is never orphaned by gateways that disagree on who is
live). A gateway that dies stops renewing: within ``ttl`` another claims the stream. Nothing
rebalances an owned stream (a gateway that joins later owns only what frees up).

The owner stamps ``{ns}:{fleet}:kvseq:<replica>`` on each tick with ``<seq>:<crc>``: the
last batch whose writes reached Redis and a checksum of its payload (which carries the
publisher's timestamp, so a restarted publisher's equal seq does not match). A new owner
reads the stamp and replays, from its own log of the writes it did not make as a non-owner,
every batch after it. When its log does not reach back that far, or the stamp names a batch
it never saw (another publisher process, a stamp lost with Redis), it resyncs instead: the
replica's shared entry is rewritten from the new owner's exact holder set.

Two writers overlap for at most one tick: a stalled owner whose lease expired learns it on its
next renewal and stops writing. The overlap is harmless anyway (the writes are the same
events, idempotent in effect). With Redis down nothing is renewed or written (the resilient
index skips shared writes); when it is back the leases are claimed again and each new owner
catches up from the stamp as above.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from router.core.redis_client import Client
from router.core.tasks import cancel_and_wait

log = logging.getLogger("prefix_router.kv_events")

STAMP_TTL_MS = 24 * 3600 * 1000
MIN_TTL_S = 2.0

# KEYS: lease_1..lease_n, stamp_1..stamp_n. ARGV[1] gateway id, ARGV[2] lease ttl ms,
# ARGV[3] stamp ttl ms, then n modes ('claim', 'keep', 'peek', 'release'), then n stamps ('' =
# none). Returns per stream: 1 if this gateway holds the lease after the call, the holder's id
# ('' if none), the stamp as it was before this call ('' if none).
_TICK = """
local n = #KEYS / 2
local me, ttl, sttl = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for i = 1, n do
  local lease, stampk = KEYS[i], KEYS[n + i]
  local mode, stamp = ARGV[3 + i], ARGV[3 + n + i]
  local cur = redis.call('GET', lease)
  local mine = 0
  if cur == me then
    if mode == 'release' then
      redis.call('DEL', lease)
      cur = false
    else
      redis.call('PEXPIRE', lease, ttl)
      mine = 1
    end
  elseif not cur and mode == 'claim' then
    redis.call('SET', lease, me, 'PX', ttl)
    cur = me
    mine = 1
  end
  local was = redis.call('GET', stampk)
  if mine == 1 and stamp ~= '' then redis.call('SET', stampk, stamp, 'PX', sttl) end
  out[3 * i - 2] = mine
  out[3 * i - 1] = cur or ''
  out[3 * i] = was or ''
end
return out
"""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def rendezvous(replica: str, gateways: Iterable[str]) -> str | None:
    """The gateway that prefers ``replica``: highest hash of (gateway, replica)."""

    def score(g: str) -> bytes:
        return hashlib.blake2b(f"{g}\x00{replica}".encode(), digest_size=8).digest()

    return max(gateways, key=score, default=None)


@dataclass
class LeaseView:
    mine: bool
    holder: str
    stamp: str


class StreamLeases:
    """The lease round trip of one gateway (see the module doc). ``tick`` is one pipelined
    script call for all replica streams; the subscriber acts on what it returns."""

    def __init__(
        self,
        client: Client,
        prefix: str,
        gateway_id: str,
        peers: Callable[[], Iterable[str]],
        *,
        interval_s: float = 0.5,
        ttl_s: float | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.gateway_id = gateway_id
        self.peers = peers
        self.interval_s = interval_s
        # A long lease costs little: a dead owner's gap is caught up, not lost. A short one
        # changes hands whenever a loaded gateway's loop stalls for a few ticks.
        ttl = ttl_s if ttl_s is not None else max(MIN_TTL_S, 5 * interval_s)
        self.ttl_ms = max(1, int(ttl * 1000))
        self.op_timeout_s = max(0.2, interval_s)
        self._script = client.register_script(_TICK)
        self._free_seen: set[str] = set()  # streams seen unowned on the previous tick
        self.ticks = 0
        self.errors = 0
        self.up: bool | None = None
        self._task: asyncio.Task[None] | None = None

    def lease_key(self, replica: str) -> str:
        return f"{self.prefix}kvlease:{replica}"

    def stamp_key(self, replica: str) -> str:
        return f"{self.prefix}kvseq:{replica}"

    def mode(self, replica: str, owned: bool) -> str:
        if owned:
            return "keep"
        if replica in self._free_seen:
            return "claim"
        live = {self.gateway_id, *self.peers()}
        return "claim" if rendezvous(replica, live) == self.gateway_id else "peek"

    async def tick(self, wanted: dict[str, tuple[str, str]]) -> dict[str, LeaseView] | None:
        """``wanted``: replica -> (mode, stamp). None when Redis did not answer."""
        self.ticks += 1
        if not wanted:
            return {}
        urls = list(wanted)
        keys = [self.lease_key(u) for u in urls] + [self.stamp_key(u) for u in urls]
        args: list[Any] = [self.gateway_id, self.ttl_ms, STAMP_TTL_MS]
        args += [wanted[u][0] for u in urls] + [wanted[u][1] for u in urls]
        try:
            res = await asyncio.wait_for(self._script(keys=keys, args=args), self.op_timeout_s)
        except Exception as exc:
            self.errors += 1
            if self.up is not False:
                log.warning("KV event leases: Redis unreachable (%r)", exc)
            self.up = False
            return None
        self.up = True
        out = {}
        for i, u in enumerate(urls):
            view = LeaseView(bool(int(res[3 * i])), _text(res[3 * i + 1]), _text(res[3 * i + 2]))
            out[u] = view
            if view.holder:
                self._free_seen.discard(u)
            else:
                self._free_seen.add(u)
        return out

    async def release(self, replicas: Iterable[str]) -> None:
        """Give up these leases at once (graceful shutdown): a peer claims them next tick."""
        wanted = {u: ("release", "") for u in replicas}
        if wanted:
            await self.tick(wanted)

    def start(self, run: Callable[[], Any]) -> None:
        async def loop() -> None:
            while True:
                try:
                    await run()
                except Exception:
                    log.exception("KV event lease tick failed")
                await asyncio.sleep(self.interval_s)

        self._task = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
