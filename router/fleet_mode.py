"""Fleet mode: several gateways share one prefix map, the ring's members and their load
through Redis. Redis being down only degrades routing to this gateway's local view.

    FleetMode.start() -> the index to route with (Redis behind a local fallback)
    every sync tick   -> the other gateways' load on each replica, the shared ring members
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from router.config import Config
from router.fleet import Fleet
from router.index import MemoryIndex, PrefixIndex
from router.index.redis import RedisIndex, make_client
from router.index.resilient import ResilientIndex
from router.metrics import Metrics
from router.shared_state import FleetSync, new_gateway_id

log = logging.getLogger("prefix_router")

Spawn = Callable[[Coroutine[Any, Any, None]], None]


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
        assert config.redis_url
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self._spawn = spawn
        self._on_change = on_change
        self.model = fleet.base_model() or "default"
        self.redis = make_client(config.redis_url)
        self.index: ResilientIndex | None = None
        self.sync: FleetSync | None = None
        self._sync_was_up = True

    async def start(self) -> PrefixIndex:
        config = self.config
        capacity = config.capacity_blocks or 65_536
        shared = RedisIndex(
            self.redis,
            self.model,
            namespace=config.redis_prefix,
            default_capacity=capacity,
            refresh_blocks=config.redis_refresh_blocks or None,  # router/index/redis.py
        )
        self.index = ResilientIndex(
            shared, MemoryIndex(capacity), match_timeout_s=config.redis_timeout_ms / 1000
        )
        self.index.on_state_change(self._on_redis_state)
        self.metrics.redis_up.set(1 if await self.index.start() else 0)
        fleet = self.fleet
        self.sync = FleetSync(
            self.redis,
            self.model,
            new_gateway_id(),
            self._local_load,
            lambda: {r.url for r in fleet.healthy()},
            namespace=config.redis_prefix,
            interval_s=config.sync_interval_s,
            on_tick=self._on_tick,
        )
        await self.sync.start()
        return self.index

    async def stop(self) -> None:
        """Stop syncing (the index is closed by its owner, the gateway), then disconnect."""
        if self.sync is not None:
            await self.sync.stop()

    async def close(self) -> None:
        await self.redis.aclose()

    @property
    def members(self) -> set[str] | None:
        """The replicas some gateway sees healthy (None until the first sync)."""
        return self.sync.members if self.sync is not None else None

    # -- callbacks ---------------------------------------------------------------------------
    def _local_load(self) -> dict[str, tuple[int, int]]:
        return {u: (r.inflight, r.pending_prefill_tokens) for u, r in self.fleet.replicas.items()}

    def _on_redis_state(self, up: bool) -> None:
        self.metrics.redis_up.set(1 if up else 0)
        if not up:
            self._drop_pooled_connections()

    def _on_tick(self, sync: FleetSync) -> None:
        if self._sync_was_up and sync.redis_up is False:
            self._drop_pooled_connections()
        self._sync_was_up = sync.redis_up is not False
        remote = sync.remote_load
        for url, r in self.fleet.replicas.items():
            r.remote_inflight, r.remote_prefill_tokens = remote.get(url, (0, 0))
        self._on_change()

    def _drop_pooled_connections(self) -> None:
        # Connections pooled before an outage are dead sockets that redis-py hands out again
        # once Redis is back: each fails one call, which re-opens the circuit for another
        # probe interval (a restart flapped for seconds). Drop them all while Redis is down;
        # calls reconnect on demand.
        self._spawn(self._disconnect_pool())

    async def _disconnect_pool(self) -> None:
        try:
            await self.redis.connection_pool.disconnect()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.debug("dropping pooled Redis connections failed: %r", exc)
