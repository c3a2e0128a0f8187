"""The fleet as one gateway sees it, wired together: the replicas and their health
(router/fleet/replicas.py), the index of what they hold, the ring of prefix owners, and what joins
this gateway to others (fleet mode's Redis, DNS discovery). The request path reads it; only
the gateway's lifecycle (router/gateway.py) opens and closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from router.config import Config
from router.disagg import roles
from router.fleet.discovery import DnsDiscovery
from router.fleet.mode import FleetMode, Spawn
from router.fleet.outlier import OutlierPolicy
from router.fleet.replicas import Fleet, Replica, Role
from router.fleet.shared_state import FleetSync
from router.index import MemoryIndex, PrefixIndex
from router.kv_events import KVEventSubscriber
from router.schedule import Rings
from router.telemetry.metrics import Metrics

log = logging.getLogger("prefix_router")

FleetListener = Callable[[Replica, str], Awaitable[None]]


class FleetWiring:
    """Replicas, index, ring and the links to other gateways, for one gateway process."""

    def __init__(self, config: Config, metrics: Metrics, index: PrefixIndex | None) -> None:
        self.config = config
        self.metrics = metrics
        self.index: PrefixIndex = index or MemoryIndex(config.routing.capacity_blocks or 65_536)
        self.ring = Rings(virtual_nodes=config.routing.virtual_nodes)  # one ring per model
        self.session: aiohttp.ClientSession | None = None  # health checks and scrapes
        self._fleet: Fleet | None = None
        self.fleet_mode: FleetMode | None = None  # Redis shared with other gateways
        self.discovery: DnsDiscovery | None = None  # DNS discovery of replicas, if configured
        self.role_discovery: list[DnsDiscovery] = []  # a name per P/D role, if configured
        self.kv_events: KVEventSubscriber | None = None  # precise mode (router/kv_events/)
        self._model_reported = asyncio.Event()  # a replica reported its models (start-up wait)
        self.fleet_listeners: list[FleetListener] = []  # after the wiring's own handling
        self.on_discovered: Callable[[], None] = lambda: None  # DNS changed the replicas

    @property
    def fleet(self) -> Fleet:
        """The replicas (once ``open`` ran: the gateway serves nothing before)."""
        assert self._fleet is not None
        return self._fleet

    @property
    def opened(self) -> Fleet | None:
        """The fleet if ``open`` ran, else None (offline commands have none)."""
        return self._fleet

    @property
    def sync(self) -> FleetSync | None:
        """Fleet mode's load and membership sync (None on a standalone gateway)."""
        return self.fleet_mode.sync if self.fleet_mode is not None else None

    async def open(self) -> None:
        """The replicas' session and health loop, and the first DNS lookup if configured."""
        config = self.config
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        headers = (
            {"Authorization": f"Bearer {config.forwarding.upstream_api_key}"}
            if config.forwarding.upstream_api_key
            else {}
        )
        listed = roles.configured(config)
        self._fleet = Fleet(
            [url for url, _ in listed],
            self.session,
            health_interval_s=config.health.health_interval_s,
            metrics_interval_s=config.health.metrics_interval_s,
            outlier=outlier_policy(config),
            first_byte_timeout_s=config.forwarding.first_byte_timeout_s,
            first_byte_timeout_floor_s=config.forwarding.first_byte_timeout_floor_s,
            first_byte_timeout_factor=config.forwarding.first_byte_timeout_factor,
            upstream_headers=headers,
            on_event=self._on_fleet_event,
        )
        for url, role in listed:
            self._fleet.replicas[url].role = role
        await self._fleet.start()
        if config.discovery.discovery_dns:
            self.discovery = DnsDiscovery.from_config(config.discovery, self._on_discovered)
            await self.discovery.start()  # the first lookup completes before serving
        for role, name in roles.dns_names(config):  # one name per P/D role
            settings = dataclasses.replace(config.discovery, discovery_dns=name)
            found = functools.partial(self._on_discovered, role=role)
            discovery = DnsDiscovery.from_config(settings, found)
            self.role_discovery.append(discovery)
            await discovery.start()

    async def wait_for_a_model(self, has_renderer: bool = False) -> None:
        """With no tokenizer configured the gateway renders with the models the replicas
        report: wait (bounded) for one to come up, as replicas started alongside take seconds."""
        if self.config.routing.tokenizer or has_renderer or self.fleet.base_model():
            return  # a model coming up later joins the registry then
        states = "; ".join(
            f"{r.url}: {'up' if r.healthy else r.health_error or 'not checked yet'}"
            for r in self.fleet.replicas.values()
        )
        log.info(
            "waiting up to %gs for a replica to report its model at /v1/models (no --tokenizer "
            "given; pass one to start without waiting): %s",
            self.config.server.startup_wait_s,
            states or "no replicas yet",
        )
        # The fleet's health loop probes the replicas and fetches their models.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._model_reported.wait(), self.config.server.startup_wait_s)

    async def join_fleet_mode(self, spawn: Spawn) -> None:
        """Share the index, the ring and the load with the other gateways on Redis."""
        self.fleet_mode = FleetMode(self.config, self.fleet, self.metrics, spawn, self.sync_ring)
        self.index = await self.fleet_mode.start()

    async def _on_discovered(self, urls: list[str], role: Role | None = None) -> None:
        """DNS says the replicas are ``urls``: those of ``role`` with a name per role; with
        P/D configured, the generic name's are the ``both`` ones (the others stay)."""
        if role is None and roles.disaggregating(self.config):
            role = "both"
        await self.fleet.set_urls(urls, role)
        await self.apply_capacities()
        self.sync_ring()
        self.on_discovered()

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        for discovery in self.role_discovery:
            await discovery.stop()
        if self.fleet_mode is not None:
            await self.fleet_mode.stop()
        if self._fleet is not None:
            await self._fleet.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.index.close()
        if self.fleet_mode is not None:
            await self.fleet_mode.close()
        if self.session:
            await self.session.close()

    def sync_ring(self) -> None:
        """The rings hold the replicas some gateway sees healthy (fleet mode: the same set on
        every gateway, so cold prefixes land alike), one ring per model over the replicas that
        report serving it; routing still skips what this gateway sees down."""
        fleet = self.fleet
        members = self.fleet_mode.members if self.fleet_mode is not None else None
        if members is None:
            members = {r.url for r in fleet.healthy()}
        self.ring.set_members(members, fleet.model_groups())
        for url, r in fleet.replicas.items():
            self.metrics.replica_healthy.labels(url).set(1 if r.healthy else 0)

    async def apply_capacities(self) -> None:
        for r in self.fleet.replicas.values():
            await self.apply_capacity(r)

    async def apply_capacity(self, replica: Replica) -> None:
        blocks_ = self.config.routing.capacity_blocks or replica.stats.num_gpu_blocks
        if blocks_:
            await self.index.set_capacity(replica.url, blocks_)

    async def _on_fleet_event(self, replica: Replica, event: str) -> None:
        if event == "models" and self.fleet.base_model():
            self._model_reported.set()
        if self.kv_events is not None:  # a health gap may hide a restart from the stream
            self.kv_events.on_fleet_event(replica.url, event)
        if event in ("removed", "restarted"):
            await self.index.drop_replica(replica.url)
        if event == "capacity":
            await self.apply_capacity(replica)
        if event == "ejected":
            self.metrics.ejections.labels(replica.url, replica.ejection_reason or "").inc()
        self.sync_ring()
        for listener in list(self.fleet_listeners):
            await listener(replica, event)

    async def reset_replica(self, url: str, keep: list[int]) -> None:
        """Forget what the index believed ``url`` holds, but ``keep``."""
        await self.index.drop_replica(url)
        if self._fleet is not None and url in self._fleet.replicas:
            await self.apply_capacity(self._fleet.replicas[url])
        await self.index.record(url, keep)


def outlier_policy(config: Config) -> OutlierPolicy:
    return OutlierPolicy(
        window_s=config.health.outlier_window_s,
        min_requests=config.health.outlier_min_requests,
        error_ratio=config.health.outlier_error_ratio,
        consecutive_failures=config.health.eject_after_failures,
        base_ejection_s=config.health.ejection_base_s,
        max_ejection_s=config.health.ejection_max_s,
        max_ejected_percent=config.health.max_ejected_percent,
        decay_s=config.health.ejection_decay_s,
    )
