"""The gateway: one process's owners, wired together, and their lifecycle.

    FleetWiring (router/fleet/wiring.py)        replicas, index, ring, fleet mode, discovery
    RequestPath (router/routing/request_path.py)  prepare -> plan (decide) -> record -> learn
    Exchanges   (router/routing/exchange.py)      a routed request's life: admit, plan, legs, close
    Forwarder   (router/routing/forwarder.py)    the other endpoints: pick, account, send, retry

``start`` brings them up in order (the fleet, a model, fleet mode, the model registry with
its tokenizers and block sizes, precise mode, flow control) and ``stop`` takes them down. The HTTP surface (router/http/handlers.py,
router/http/app.py) and the ops modules drive the owners; the properties below are the handles
operators and tests read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from router.config import Config
from router.core.tasks import Background
from router.disagg.collect import Collect
from router.disagg.watch import PdWatch
from router.fleet.mode import FleetMode
from router.fleet.replicas import Fleet, Replica
from router.fleet.shared_state import FleetSync
from router.fleet.wiring import FleetListener, FleetWiring
from router.flow.controller import FlowController
from router.flow.sessions import ResponseChains
from router.flow.shared import UsageShare
from router.index import PrefixIndex
from router.intake.budget import SharedBudget, share_of
from router.intake.held import HELD_FACTOR, HeldBytes
from router.intake.json_check import JsonCheck
from router.intake.routed_request import Endpoint
from router.intake.shapes import BodyLimits
from router.kv_events import KVEventSubscriber, SettleOnOutcome, start_for
from router.models import ModelEntry, ModelRegistry, tokenizers
from router.models.loading import load_renderer, tokenizer_source
from router.prompt import Renderer
from router.readiness import Readiness, assess
from router.routing.exchange import Exchanges
from router.routing.forwarder import Forwarder, Retries
from router.routing.learning import Observer
from router.routing.prepare import DEFAULT_BLOCK_SIZE, LARGE_BODY_BYTES, ChatConverter
from router.routing.request_path import RequestPath
from router.routing.retry_budget import RetryBudget
from router.schedule import Pipeline, Rings
from router.telemetry.metrics import Metrics
from router.tenancy.tenants import Tenancy
from router.upstream.client import UpstreamPool
from router.upstream.proxy import header_allow_list

log = logging.getLogger("prefix_router")

__all__ = ["DEFAULT_BLOCK_SIZE", "LARGE_BODY_BYTES", "Gateway", "release_free_memory"]


def release_free_memory() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the OS (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Gateway:
    """One gateway process: the fleet wiring, the request path, the exchanges and the
    forwarder."""

    def __init__(
        self,
        config: Config,
        renderer: Renderer | None = None,
        index: PrefixIndex | None = None,
        converters: Mapping[Endpoint, ChatConverter] | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(
            max(1, config.server.tokenize_threads), thread_name_prefix="tokenize"
        )
        self.background = Background()
        self.wiring = FleetWiring(config, self.metrics, index)
        self.path = RequestPath(
            config,
            self.metrics,
            self.wiring,
            self.executor,
            self.background.spawn,
            renderer,
            converters,
        )
        # The proxy path's own client (router/upstream/client.py); the wiring's session serves the
        # fleet's health checks and scrapes.
        self.upstream = UpstreamPool(
            connect_timeout=config.forwarding.connect_timeout_s,
            read_timeout=max(
                config.forwarding.first_byte_timeout_s, config.forwarding.idle_timeout_s
            ),
            on_rewritten_id=self._rewritten_id,
        )
        self._rewriting_hops: set[str] = set()
        # Trying another replica before the first byte: one set of rules for the routed
        # exchanges and the forwarded jobs (router/routing/forwarder.py).
        retries = Retries(
            self.metrics,
            config.forwarding.max_retries,
            self.wiring.sync_ring,  # the ring follows the replicas' health
            RetryBudget(
                config.forwarding.retry_budget_percent,
                config.forwarding.retry_budget_min_concurrency,
            ),
        )
        self.forwarder = Forwarder(self.upstream, self.metrics, lambda: self.wiring.fleet, retries)
        # A routed request's life after prepare (router/routing/exchange.py).
        self.exchanges = Exchanges(
            self.path,
            retries,
            lambda: self.wiring.fleet,
            decision_headers=(
                config.routing.decision_headers
                if config.routing.decision_headers is not None
                else not config.auth.enabled
            ),
            auth=config.auth.enabled,
            collect=Collect(self.upstream),
            pd=PdWatch(self.metrics.registry),
        )
        self.forward_allow = header_allow_list(
            config.auth.enabled, config.forwarding.forward_headers
        )
        self.draining = False
        # What start-up reports (router/http/startup.py): where the tokenizer and the block size
        # came from, whether it listens and has said "gateway ready".
        self.block_size_source = "--block-size" if config.routing.block_size else "the default"
        self.tokenizer_source = "given by the caller" if renderer is not None else "not loaded"
        self.listening = False
        self.announced_ready = False
        # Request-body bytes being received now, with each client's share (router/http/handlers.py).
        self.body_bytes = SharedBudget(
            config.limits.max_inflight_body_bytes,
            share_of(
                config.limits.max_inflight_body_bytes,
                config.limits.client_share,
                config.limits.max_body_bytes,
            ),
        )
        # Bodies held once they arrived (queued, forwarded), with each client's share
        # (router/intake/held.py): what a waiting request holds is bounded, not only its arrival.
        self.held = HeldBytes(
            config.limits.max_held_body_bytes,
            share_of(
                config.limits.max_held_body_bytes,
                config.limits.client_share,
                math.ceil(HELD_FACTOR * config.limits.max_body_bytes),
            ),
            lambda reason: self.metrics.rejected.labels(reason).inc(),
        )
        # Costly JSON bodies are parsed and held to the limits in a child process first, with
        # each client's share of the bytes waiting for it (router/intake/json_check.py).
        self.json_check = JsonCheck(
            self.limits,
            SharedBudget(
                config.limits.max_inflight_body_bytes,
                share_of(
                    config.limits.max_inflight_body_bytes,
                    config.limits.client_share,
                    config.limits.max_body_bytes,
                ),
            ),
            self._json_checked,
        )
        self.flow_share: UsageShare | None = None  # fleet mode: per-tenant usage in Redis
        # The registry follows the fleet: replicas come, go, report models and capacity.
        self.wiring.fleet_listeners.append(self._refresh_models_on)
        self.wiring.on_discovered = self.path.upkeep.refresh

    def _rewritten_id(self, origin: str) -> None:
        """An answer carried an X-Request-Id the gateway never sent: a hop that sets its own
        (router/upstream/client.py). Counted; logged once per replica."""
        self.metrics.child(self.metrics.rewritten_ids, origin).inc()
        if origin not in self._rewriting_hops:
            self._rewriting_hops.add(origin)
            log.warning(
                "%s answers with X-Request-Id values the gateway never sent: something between "
                "them sets its own request ids; accepted (crossed answers are still refused)",
                origin,
            )

    def _json_checked(self, outcome: str) -> None:
        if outcome == "busy":
            self.metrics.rejected.labels("json_check").inc()
        else:
            self.metrics.json_checks.labels(outcome).inc()

    async def _refresh_models_on(self, replica: Replica, event: str) -> None:
        if event in ("models", "capacity", "removed", "healthy"):
            self.path.upkeep.refresh()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:  # a failed or interrupted start leaves no session or task open
            await self.stop()
            raise

    async def _start(self) -> None:
        config, wiring, path = self.config, self.wiring, self.path
        # Before any worker thread can: a first import racing in two threads failed.
        tokenizers.import_transformers()
        await wiring.open()
        await wiring.wait_for_a_model(path.renderer is not None)  # the registry, fleet mode
        if config.fleet.redis_url:
            await wiring.join_fleet_mode(self.background.spawn)
        wiring.sync_ring()
        await self._load_models()
        if config.kv_events.enabled:
            sub = await start_for(
                config,
                wiring.fleet,
                wiring.index,
                lambda url: path.upkeep.block_size_of(url, path.block_size),
                self.metrics,
                wiring.fleet_mode,
                namespace=path.upkeep.namespace_of,
            )
            wiring.kv_events = sub
            wiring.index = sub.index  # the events' index over the gateway's
            self.watch(SettleOnOutcome(sub.settle, sub.reject))
        flow = path.flow
        await flow.start()
        if wiring.fleet_mode is not None and flow.config.enabled:
            fleet_mode, fleet = wiring.fleet_mode, wiring.fleet
            self.flow_share = UsageShare(
                flow,
                lambda: fleet_mode.redis,
                config.fleet.redis_prefix,
                lambda: fleet.models(),
                config.fleet.sync_interval_s,
            )
            await self.flow_share.start()
        await wiring.apply_capacities()

    async def _load_models(self) -> None:
        """Build the registry from what the replicas reported and load every model's
        tokenizer (start-up: a contradicted block size is refused here, in one line)."""
        path, models = self.path, self.path.models
        loop = asyncio.get_running_loop()
        await path.upkeep.load_all()
        if not models.entries and path.renderer is None:
            # No replica reported a model: --tokenizer, or the one clear line that says why not.
            path.renderer = await loop.run_in_executor(
                self.executor,
                load_renderer,
                self.config.routing.tokenizer,
                None,
                self.config.limits.max_prompt_chars,
            )
            models.injected = path.renderer
        if path.renderer is not None:
            await loop.run_in_executor(self.executor, path.renderer.max_chars_per_token)
        default = models.default()
        if default is not None:
            path.block_size = default.block_size
            if path.renderer is None:
                path.renderer = default.renderer  # a body without ``model`` offline
        self.describe_models()

    def readiness(self) -> Readiness:
        """Whether this gateway can route exactly now, and what it waits for if not (defined
        once, in router/readiness.py)."""
        assert self.fleet is not None
        return assess(self.fleet, self.path.models.entries, self.draining)

    def describe_models(self) -> None:
        """The start-up summary's tokenizer and block-size lines (router/http/startup.py)."""
        entries = sorted(self.path.models.entries.values(), key=lambda e: e.name)
        if not entries:
            if self.path.renderer is not None and self.config.routing.tokenizer:
                self.tokenizer_source = tokenizer_source(self.config.routing.tokenizer, None)
            return
        sources = {
            "replicas": "reported by the replicas in vllm:cache_config_info",
            "config": "models: in the config",
            "flag": "--block-size",
            "default": "the default: no replica reported vllm:cache_config_info",
        }

        def tokenizer_of(e: ModelEntry) -> str:
            if e.renderer is None:
                return "none found: matched by a text prefix"
            if e.tokenizer_origin == "injected":
                return "given by the caller"
            if e.tokenizer_origin == "bundled":
                return f"the bundled one for {e.name} ({e.tokenizer})"
            return f"{e.tokenizer} ({e.tokenizer_origin})"

        if len(entries) == 1:
            (e,) = entries
            self.tokenizer_source = tokenizer_of(e)
            self.block_size_source = sources[e.block_size_origin]
            return
        self.tokenizer_source = "; ".join(f"{e.name}: {tokenizer_of(e)}" for e in entries)
        self.block_size_source = "; ".join(
            f"{e.name}: {e.block_size}, {sources[e.block_size_origin]}" for e in entries
        )

    async def stop(self) -> None:
        self.draining = True
        self.json_check.close()
        await self.background.wait()
        await self.path.flow.stop()
        if self.flow_share is not None:
            await self.flow_share.stop()
        await self.wiring.close()
        self.upstream.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def decoder(self, model: str) -> Callable[[Sequence[int]], str] | None:
        """``model``'s token ids to text with its own tokenizer (diagnostics); None where
        it has none (router/models/upkeep.py)."""
        return self.path.upkeep.decoder(model, self.path.renderer)

    def spawn(self, coro: Any) -> None:
        self.background.spawn(coro)

    def watch(self, observer: Observer) -> None:
        """``observer`` sees every finished request from now on."""
        self.path.observers.append(observer)

    # -- handles, read by operators' tools, precise mode and the tests ----------------------
    @property
    def receiving_bytes(self) -> int:
        """Request-body bytes being received now, all clients together."""
        return self.body_bytes.held

    @property
    def fleet(self) -> Fleet | None:
        return self.wiring.opened

    @property
    def index(self) -> PrefixIndex:
        return self.wiring.index

    @index.setter
    def index(self, index: PrefixIndex) -> None:
        self.wiring.index = index

    @property
    def ring(self) -> Rings:
        return self.wiring.ring

    @property
    def fleet_mode(self) -> FleetMode | None:
        return self.wiring.fleet_mode

    @property
    def sync(self) -> FleetSync | None:
        return self.wiring.sync

    @property
    def kv_events(self) -> KVEventSubscriber | None:
        return self.wiring.kv_events

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.wiring.session

    @property
    def policy(self) -> Pipeline:
        return self.path.policy

    @property
    def renderer(self) -> Renderer | None:
        return self.path.renderer

    @property
    def block_size(self) -> int:
        return self.path.block_size

    @property
    def models(self) -> ModelRegistry:
        return self.path.models

    @property
    def flow(self) -> FlowController:
        return self.path.flow

    @property
    def response_chains(self) -> ResponseChains:
        return self.path.response_chains

    @property
    def lazy_tail(self) -> bool:
        return self.path.lazy_tail

    @property
    def fleet_listeners(self) -> list[FleetListener]:
        """Watchers of the fleet's replica events (router/http/startup.py): await listener(replica,
        event)."""
        return self.wiring.fleet_listeners

    @property
    def tenancy(self) -> Tenancy:
        return self.path.tenancy

    @property
    def limits(self) -> BodyLimits:
        return self.path.limits

    @property
    def observers(self) -> list[Observer]:
        return self.path.observers

    @property
    def _background(self) -> set[asyncio.Task[Any]]:
        return self.background.tasks
