"""Fleet mode: several gateways share one prefix map, the ring's members and their load
through Redis. Redis being down only degrades routing to this gateway's local view.

Keys (router/index/redis.py, router/fleet/shared_state.py): each model's index under its own tag,
``{ns}:{<model>}:blocks:<replica>`` for the model ``<replica>`` reports serving; what is shared
about the fleet as a whole (load, ring members, stream leases) under ``{ns}:{fleet}:``. No key
depends on which model a gateway saw first.

    FleetMode.start() -> the index to route with (Redis behind a local fallback)
    every sync tick   -> the other gateways' load on each replica, the shared ring members
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from redis.asyncio import ConnectionPool

from router.config import Config
from router.core.redis_client import aclose, fresh_pool, make_client, parse_redis_url
from router.core.tasks import cancel_and_wait
from router.fleet.replicas import Fleet
from router.fleet.shared_state import FLEET_SCOPE, FleetSync, new_gateway_id
from router.index import MemoryIndex, PrefixIndex
from router.index.redis import RedisIndex
from router.index.redis_map import RedisMapIndex
from router.index.resilient import ResilientIndex
from router.telemetry.metrics import Metrics

log = logging.getLogger("prefix_router")

Spawn = Callable[[Coroutine[Any, Any, None]], None]

# The tag of a replica's index keys while its model is not known (it takes no request
# meanwhile); what gateways share about the whole fleet is under FLEET_SCOPE's tag.
UNKNOWN_MODEL = "unknown-model"

# A replaced connection pool is closed this long after: longer than any call's timeout.
RETIRE_POOL_AFTER_S = 10.0


class FleetMode:
    """The Redis client, the resilient shared index and the load/membership sync of one
    gateway. ``on_change`` runs after every sync tick (the gateway re-syncs its ring)."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        metrics: Metrics,
        spawn: Spawn,
        on_change: Callable[[], None],
    ) -> None:
        assert config.fleet.redis_url
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self._spawn = spawn
        self._on_change = on_change
        self.target = parse_redis_url(config.fleet.redis_url)  # one server, cluster, sentinel
        self.redis = make_client(config.fleet.redis_url)
        self.index: ResilientIndex | None = None
        self.sync: FleetSync | None = None
        self._sync_was_up = True
        self._retired: list[ConnectionPool] = []  # pools replaced after an outage, closing
        # Their timers: our own, not the gateway's background tasks, which a shutdown waits
        # for (it would wait out RETIRE_POOL_AFTER_S after any outage).
        self._retiring: set[asyncio.Task[None]] = set()

    async def start(self) -> PrefixIndex:
        config = self.config
        capacity = config.routing.capacity_blocks or 65_536
        shared: RedisIndex | RedisMapIndex
        if config.fleet.redis_layout == "zsets":
            shared = RedisIndex(
                self.redis,
                UNKNOWN_MODEL,
                model_of=self.fleet.model_of,  # each model's keys under its own tag
                namespace=config.fleet.redis_prefix,
                default_capacity=capacity,
                refresh_blocks=config.fleet.redis_refresh_blocks or None,  # router/index/redis.py
            )
        else:  # one hash per model: a match is one HMGET, writes batched (redis_map.py)
            shared = RedisMapIndex(
                self.redis,
                UNKNOWN_MODEL,
                model_of=self.fleet.model_of,
                namespace=config.fleet.redis_prefix,
                default_capacity=capacity,
                refresh_blocks=config.fleet.redis_refresh_blocks or None,
                # Precise mode: one gateway writes a replica's events, the others their
                # placements; a placement sent late could land after the event that evicted
                # it, so writes go at once (still batched while a flush is in flight).
                flush_interval_s=0.0
                if config.kv_events.enabled
                else config.fleet.redis_flush_ms / 1000,
            )
        self.index = ResilientIndex(
            shared, MemoryIndex(capacity), match_timeout_s=config.fleet.redis_timeout_ms / 1000
        )
        self.index.on_state_change(self._on_redis_state)
        self.metrics.redis_up.set(1 if await self.index.start() else 0)
        fleet = self.fleet
        self.sync = FleetSync(
            self.redis,
            FLEET_SCOPE,
            new_gateway_id(),
            self._local_load,
            lambda: {r.url for r in fleet.healthy()},
            namespace=config.fleet.redis_prefix,
            interval_s=config.fleet.sync_interval_s,
            on_tick=self._on_tick,
        )
        await self.sync.start()
        return self.index

    async def stop(self) -> None:
        """Stop syncing (the index is closed by its owner, the gateway), then disconnect."""
        if self.sync is not None:
            await self.sync.stop()

    async def close(self) -> None:
        await cancel_and_wait(*self._retiring)
        for pool in list(self._retired):
            await self._close_pool(pool)
        await aclose(self.redis)

    @property
    def members(self) -> set[str] | None:
        """The replicas some gateway sees healthy (None until the first sync)."""
        return self.sync.members if self.sync is not None else None

    # -- callbacks ---------------------------------------------------------------------------
    def _local_load(self) -> dict[str, tuple[int, int]]:
        return {u: (r.inflight, r.pending_prefill_tokens) for u, r in self.fleet.replicas.items()}

    def _on_redis_state(self, up: bool) -> None:
        self.metrics.redis_up.set(1 if up else 0)
        self._fresh_pool()

    def _on_tick(self, sync: FleetSync) -> None:
        sync_up = sync.redis_up is not False
        if sync_up != self._sync_was_up:
            self._fresh_pool()
        self._sync_was_up = sync_up
        remote = sync.remote_load
        for url, r in self.fleet.replicas.items():
            r.remote_inflight, r.remote_prefill_tokens = remote.get(url, (0, 0))
        self._on_change()

    def _fresh_pool(self) -> None:
        """On every open or close of a circuit, later calls take a new connection pool.

        A connection pooled across an outage is a dead socket that redis-py hands out again
        once Redis is back ("Connection closed by server"): each fails one call and re-opens
        a circuit for another probe interval (a restart flapped for seconds). Disconnecting
        the pooled connections in place raced with calls taking them, and cut those calls;
        a new pool cannot: calls already on the old one finish there, and it is closed once
        they have had their timeout. (A cluster client reconnects a node's connections after
        an error itself: nothing to replace.)"""
        old = fresh_pool(self.redis)
        if old is None:
            return
        self._retired.append(old)
        task = asyncio.get_running_loop().create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, pool: ConnectionPool) -> None:
        await asyncio.sleep(RETIRE_POOL_AFTER_S)  # a timer: its calls are over by then
        await self._close_pool(pool)

    async def _close_pool(self, pool: ConnectionPool) -> None:
        if pool in self._retired:
            self._retired.remove(pool)
        try:
            await pool.disconnect()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.debug("closing a retired Redis connection pool failed: %r", exc)
