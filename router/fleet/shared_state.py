"""Fleet mode: gateways share their load and their view of replica health through Redis.

``FleetSync`` runs one background tick every ``interval_s``; each tick is ONE pipelined round
trip that

* publishes this gateway's entry -- its own in-flight requests and queued (sent, not yet
  answered) prefill tokens per replica, and the replicas it considers healthy -- as a string
  key with a TTL of ``ttl_s`` (3 x interval by default), so the entry of a gateway that
  crashes or hangs disappears by itself;
* registers the gateway id in the fleet's gateway set, and reads the entries of every gateway
  in that set.

From that it exposes ``remote_load`` (per replica, the sum over the *other* live gateways) and
``members`` (the replicas that at least one live gateway, this one included, reports healthy:
every gateway builds its consistent-hash ring from the same set). Keys::

    {ns}:{<scope>}:gw:<gateway_id>   STRING JSON {"load": {replica: [inflight, queued]},
                                                  "healthy": [replica, ...]}; PX ttl
    {ns}:{<scope>}:gateways          SET    gateway ids (discovery only; ids whose entry has
                                            expired are pruned by the next reader)

All keys carry the ``{<scope>}`` hash tag (one Redis Cluster slot). A gateway's load and
health cover every model's replicas, so fleet mode uses one scope for the whole fleet
(``fleet``), not a model: gateways that saw different models first still share it.
Entries are read with ``MGET`` (one ``GET`` each on a Redis Cluster, whose pipelines refuse
multi-key commands) of the ids found in the set on the *previous* tick, so a new
gateway is seen within two ticks; load values themselves are always as of this tick.

When Redis is unreachable ticks fail quietly (logged once on the transition, once on
recovery); the last view is served for ``max_staleness_s`` and then ``remote_load`` is empty
and ``members`` is None (route on local knowledge). Nothing here ever raises into the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import RedisCluster

from router.core.redis_client import Client, error_text
from router.core.tasks import cancel_and_wait
from router.index.redis import DEFAULT_NAMESPACE, key_prefix

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5
# The hash tag of what gateways share about the whole fleet (one Redis Cluster slot).
FLEET_SCOPE = "fleet"

Load = dict[str, tuple[int, int]]  # replica -> (in-flight requests, queued prefill tokens)


def new_gateway_id() -> str:
    """A per-process id: readable (host, pid) and unique (random suffix)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class FleetSync:
    """Publishes this gateway's load/health and reads the other gateways' (see module doc)."""

    def __init__(
        self,
        client: Client,
        model: str,
        gateway_id: str,
        get_local_load: Callable[[], Load],
        get_local_healthy: Callable[[], set[str]],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        interval_s: float = DEFAULT_INTERVAL_S,
        ttl_s: float | None = None,
        max_staleness_s: float | None = None,
        op_timeout_s: float | None = None,
        on_tick: Callable[[FleetSync], Any] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        if not gateway_id:
            raise ValueError("gateway_id must be non-empty")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.model = model
        self.gateway_id = gateway_id
        self.get_local_load = get_local_load
        self.get_local_healthy = get_local_healthy
        self.interval_s = interval_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * interval_s
        self.max_staleness_s = max_staleness_s if max_staleness_s is not None else self.ttl_s
        self.op_timeout_s = op_timeout_s if op_timeout_s is not None else interval_s
        self.on_tick = on_tick
        self.prefix = key_prefix(namespace, model)
        self.registry_key = f"{self.prefix}gateways"
        self.own_key = self.gateway_key(gateway_id)

        self.redis_up: bool | None = None  # None until the first tick
        self.ticks = 0
        self.errors = 0
        self.last_ok: float | None = None  # time.monotonic() of the last successful tick

        self._remote_load: Load = {}
        self._members: set[str] | None = None
        self._peers: set[str] = set()  # other live gateways, as of the last tick
        self._known: list[str] = []  # other gateway ids to read on the next tick
        self._dead: list[str] = []  # ids to prune from the registry on the next tick
        self._task: asyncio.Task[None] | None = None

    def gateway_key(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}"

    # the view --------------------------------------------------------------------------

    def _fresh(self) -> bool:
        return self.last_ok is not None and time.monotonic() - self.last_ok <= self.max_staleness_s

    @property
    def remote_load(self) -> Load:
        """Per replica: (in-flight requests, queued prefill tokens) summed over the other live
        gateways. Empty when Redis has not answered for longer than ``max_staleness_s``."""
        return self._remote_load if self._fresh() else {}

    @property
    def members(self) -> set[str] | None:
        """Replicas some live gateway reports healthy, or None when Redis state is unknown
        (never synced, or stale beyond ``max_staleness_s``)."""
        return self._members if self._fresh() else None

    @property
    def peers(self) -> set[str]:
        """Ids of the other live gateways (as of the last successful tick)."""
        return self._peers if self._fresh() else set()

    # lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Run one tick now (so the first requests see the fleet), then tick in the
        background."""
        if self._task is not None and not self._task.done():
            return
        await self.tick()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, *, withdraw: bool = True) -> None:
        """Stop ticking. ``withdraw`` deletes this gateway's entry at once (graceful
        shutdown); without it the entry expires after ``ttl_s``, as after a crash."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if withdraw:
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.delete(self.own_key)
                pipe.srem(self.registry_key, self.gateway_id)
                await asyncio.wait_for(pipe.execute(), self.op_timeout_s)
            except Exception as exc:
                log.debug("fleet sync: could not withdraw %s: %r", self.gateway_id, exc)

    async def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await self.tick()
            now = time.monotonic()
            next_at += self.interval_s
            if next_at < now:  # overran (loop stalled): skip the missed ticks
                next_at = now + self.interval_s

    # one tick -------------------------------------------------------------------------

    def _payload(self) -> tuple[str, set[str]]:
        try:
            load = {r: [int(a), int(b)] for r, (a, b) in self.get_local_load().items()}
        except Exception:
            log.exception("fleet sync: get_local_load failed")
            load = {}
        try:
            healthy = set(self.get_local_healthy())
        except Exception:
            log.exception("fleet sync: get_local_healthy failed")
            healthy = set()
        body = json.dumps({"load": load, "healthy": sorted(healthy)}, separators=(",", ":"))
        return body, healthy

    async def _exchange(self, body: str) -> tuple[list[str], Any, list[Any]]:
        """The tick's single pipelined round trip: (ids read, registry members, entries)."""
        known, dead = list(self._known), list(self._dead)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.own_key, body, px=max(1, int(self.ttl_s * 1000)))
        pipe.sadd(self.registry_key, self.gateway_id)
        pipe.pexpire(self.registry_key, max(60_000, int(self.ttl_s * 20_000)))
        if dead:
            pipe.srem(self.registry_key, *dead)
        pipe.smembers(self.registry_key)
        if self.cluster:  # a cluster pipeline refuses multi-key commands, even in one slot
            for g in known:
                pipe.get(self.gateway_key(g))
        elif known:
            pipe.mget([self.gateway_key(g) for g in known])
        res = await pipe.execute()
        at = 4 if dead else 3
        registry = res[at]
        values = res[at + 1 :] if self.cluster or not known else res[-1]
        return known, registry, values

    async def tick(self) -> bool:
        """One publish-and-read round trip. True on success; never raises."""
        self.ticks += 1
        body, own_healthy = self._payload()
        try:
            known, registry, values = await asyncio.wait_for(
                self._exchange(body), self.op_timeout_s
            )
        except Exception as exc:
            self.errors += 1
            if self.redis_up is not False:
                log.warning(
                    "fleet sync: Redis unreachable (%s); keeping the last fleet view "
                    "for %.1fs, then routing on local load and health",
                    error_text(exc),
                    self.max_staleness_s,
                )
            self.redis_up = False
            self._notify()
            return False

        remote: dict[str, list[int]] = {}
        members = set(own_healthy)
        peers: set[str] = set()
        gone: list[str] = []
        for gid, raw in zip(known, values, strict=True):
            if raw is None:
                gone.append(gid)
                continue
            try:
                entry = json.loads(raw)
                for replica, (inflight, queued) in entry.get("load", {}).items():
                    acc = remote.setdefault(replica, [0, 0])
                    acc[0] += int(inflight)
                    acc[1] += int(queued)
                members.update(entry.get("healthy", ()))
            except (ValueError, TypeError, AttributeError) as exc:
                log.debug("fleet sync: bad entry from gateway %s: %r", gid, exc)
                continue
            peers.add(gid)
        ids = {g.decode() if isinstance(g, bytes) else str(g) for g in registry}
        ids.discard(self.gateway_id)
        self._known = sorted(ids)
        self._dead = [g for g in gone if g in ids]
        self._remote_load = {r: (v[0], v[1]) for r, v in remote.items()}
        self._members = members
        self._peers = peers
        self.last_ok = time.monotonic()
        if self.redis_up is False:
            log.info(
                "fleet sync: Redis reachable again; sharing load and health with %d "
                "other gateway(s)",
                len(peers),
            )
        self.redis_up = True
        self._notify()
        return True

    def _notify(self) -> None:
        if self.on_tick is not None:
            try:
                self.on_tick(self)
            except Exception:
                log.exception("fleet sync: on_tick callback failed")
