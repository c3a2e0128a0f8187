"""The replicas: membership, health, load, and what they report about themselves.

Health is active (``/health`` every ``health_interval_s``) and passive (``eject_after_failures``
consecutive request failures eject a replica until ``/health`` answers again). Load is the
gateway's own in-flight requests and not-yet-answered prompt tokens per replica, plus what
other gateways publish (fleet mode), plus the replicas' scraped ``vllm:*`` gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.schedule import Candidate
from router.tasks import cancel_and_wait

log = logging.getLogger("prefix_router.fleet")

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+(\S+)", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class ReplicaStats:
    """What a replica reported on its last scrape."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def parse_vllm_metrics(text: str) -> ReplicaStats:
    """The few ``vllm:*`` samples routing reads, summed over engines. Tolerant of anything
    else on the page (a fast regex, not a full exposition parser: it runs every second)."""
    s = ReplicaStats()
    for name, labels, value in _SAMPLE.findall(text):
        try:
            v = float(value)
        except ValueError:
            continue
        if name == "vllm:num_requests_waiting":
            s.waiting += int(v)
        elif name == "vllm:num_requests_running":
            s.running += int(v)
        elif name == "vllm:kv_cache_usage_perc":
            s.kv_usage = max(s.kv_usage, v)
        elif name == "vllm:prefix_cache_queries_total":
            s.prefix_queries += v
        elif name == "vllm:prefix_cache_hits_total":
            s.prefix_hits += v
        elif name == "vllm:cache_config_info":
            kv = dict(_LABEL.findall(labels or ""))
            with contextlib.suppress(KeyError, ValueError):
                s.block_size = int(kv["block_size"])
            with contextlib.suppress(KeyError, ValueError):
                s.num_gpu_blocks = int(kv["num_gpu_blocks"])
    return s


@dataclass
class Replica:
    url: str
    healthy: bool = True
    failures: int = 0
    inflight: int = 0
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    remote_inflight: int = 0
    remote_prefill_tokens: int = 0
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # its /v1/models entries
    models: dict[str, str | None] = field(default_factory=dict)  # id -> parent (LoRA) or None
    models_known: bool = False

    def candidate(self, matched_blocks: int) -> Candidate:
        return Candidate(
            url=self.url,
            matched_blocks=matched_blocks,
            inflight=self.inflight + self.remote_inflight,
            pending_prefill_tokens=self.pending_prefill_tokens + self.remote_prefill_tokens,
            waiting=self.stats.waiting,
            running=self.stats.running,
            kv_usage=self.stats.kv_usage,
        )


ChangeHook = Callable[["Replica", str], Awaitable[None]]


class Fleet:
    def __init__(
        self,
        urls: Iterable[str],
        session: aiohttp.ClientSession,
        *,
        health_interval_s: float = 2.0,
        metrics_interval_s: float = 1.0,
        eject_after_failures: int = 3,
        upstream_headers: dict[str, str] | None = None,
        on_event: ChangeHook | None = None,
    ) -> None:
        self.replicas: dict[str, Replica] = {}
        self.session = session
        self.health_interval_s = health_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.eject_after = eject_after_failures
        self.headers = upstream_headers or {}
        self.on_event = on_event
        self._tasks: list[asyncio.Task[None]] = []
        self._ticks = 0
        for url in urls:
            self.replicas[url.rstrip("/")] = Replica(url.rstrip("/"))

    # -- membership -------------------------------------------------------------------------
    async def set_urls(self, urls: Sequence[str]) -> None:
        """Replace the membership (DNS discovery); new replicas are probed before use."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.replicas):
            if url not in wanted:
                replica = self.replicas.pop(url)
                log.info("replica removed: %s", url)
                await self._emit(replica, "removed")
        new = [Replica(u, healthy=False) for u in sorted(wanted - set(self.replicas))]
        for replica in new:
            self.replicas[replica.url] = replica
            log.info("replica added: %s", replica.url)
        await asyncio.gather(*(self._probe(r) for r in new))

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def serving(self, model: str) -> list[Replica]:
        """Healthy replicas that serve ``model`` (or have not told us what they serve)."""
        return [
            r
            for r in self.replicas.values()
            if r.healthy and (not r.models_known or model in r.models)
        ]

    def models(self) -> dict[str, dict[str, Any]]:
        """The union of the healthy replicas' model cards."""
        return {k: v for r in self.healthy() for k, v in r.cards.items()}

    def knows_models(self) -> bool:
        return any(r.models_known for r in self.healthy())

    def adapter_parent(self, model: str) -> str | None:
        for r in self.healthy():
            parent = r.models.get(model)
            if parent:
                return parent
        return None

    def base_model(self) -> str | None:
        for r in self.replicas.values():
            for model, parent in r.models.items():
                if parent is None:
                    return model
        return None

    def block_size(self) -> int | None:
        sizes = [r.stats.block_size for r in self.replicas.values() if r.stats.block_size]
        if sizes and len(set(sizes)) > 1:
            log.warning(
                "replicas report different block sizes %s; using %d", sorted(set(sizes)), sizes[0]
            )
        return sizes[0] if sizes else None

    # -- passive health ---------------------------------------------------------------------
    async def record_failure(self, replica: Replica, why: str) -> None:
        replica.failures += 1
        if replica.healthy and replica.failures >= self.eject_after:
            replica.healthy = False
            log.warning(
                "replica %s ejected after %d consecutive failures (%s)",
                replica.url,
                replica.failures,
                why,
            )
            await self._emit(replica, "ejected")

    def record_success(self, replica: Replica) -> None:
        replica.failures = 0

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every replica once (so the first request sees real health), then keep
        checking in the background."""
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))
        self._tasks = [
            asyncio.create_task(self._health_loop()),
            asyncio.create_task(self._metrics_loop()),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check_health(r) for r in list(self.replicas.values())))

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            self._ticks += 1
            healthy = self.healthy()
            await asyncio.gather(*(self._scrape(r) for r in healthy))
            if self._ticks % 30 == 0:
                await asyncio.gather(*(self._fetch_models(r) for r in healthy))

    async def _probe(self, replica: Replica) -> None:
        await self._check_health(replica)
        if replica.healthy:
            await asyncio.gather(self._scrape(replica), self._fetch_models(replica))

    async def _get(self, replica: Replica, path: str, timeout: float) -> aiohttp.ClientResponse:
        return await self.session.get(
            replica.url + path, headers=self.headers, timeout=aiohttp.ClientTimeout(total=timeout)
        )

    async def _check_health(self, replica: Replica) -> None:
        try:
            async with await self._get(replica, "/health", 3.0) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok and not replica.healthy:
            replica.healthy, replica.failures = True, 0
            log.info("replica %s healthy", replica.url)
            await self._emit(replica, "healthy")
            await asyncio.gather(self._scrape(replica), self._fetch_models(replica))
        elif not ok and replica.healthy:
            replica.healthy = False
            log.warning("replica %s failed its health check", replica.url)
            await self._emit(replica, "unhealthy")

    async def _scrape(self, replica: Replica) -> None:
        try:
            async with await self._get(replica, "/metrics", 3.0) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
            return
        old, new = replica.stats, parse_vllm_metrics(text)
        replica.stats = new
        if new.prefix_queries < old.prefix_queries:
            # Counters went backwards: the replica restarted and its cache is empty.
            log.info("replica %s restarted (counters reset); forgetting its cache", replica.url)
            await self._emit(replica, "restarted")
        if new.num_gpu_blocks != old.num_gpu_blocks and new.num_gpu_blocks:
            await self._emit(replica, "capacity")

    async def _fetch_models(self, replica: Replica) -> None:
        try:
            async with await self._get(replica, "/v1/models", 3.0) as resp:
                if resp.status != 200:
                    return
                data = await resp.json(content_type=None)
            cards = {str(m["id"]): m for m in data.get("data", []) if isinstance(m, dict)}
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ):
            return
        replica.cards = cards
        replica.models = {
            k: (str(v["parent"]) if v.get("parent") else None) for k, v in cards.items()
        }
        replica.models_known = True

    async def _emit(self, replica: Replica, event: str) -> None:
        if self.on_event is not None:
            await self.on_event(replica, event)
