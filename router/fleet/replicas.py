"""The replicas: membership, health, load, and what they report about themselves.

Health is active (``/health`` every ``health_interval_s``) and passive (outlier detection,
router/fleet/outlier.py): a replica whose requests fail -- ``eject_after_failures`` in a row, or more
than a share of them in a sliding window -- is ejected for a time that grows with each recent
ejection, and ``/health`` cannot readmit it before that time is up. A replica in rotation is
``healthy``: its last ``/health`` answered and it is not ejected. Load is the
gateway's own in-flight requests and not-yet-answered prompt tokens per replica, plus what
other gateways publish (fleet mode), plus the replicas' scraped ``vllm:*`` gauges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from router.core.tasks import cancel_and_wait
from router.fleet.outlier import ErrorWindow, Latency, OutlierPolicy
from router.fleet.probes import (
    HEALTH_TIMEOUT_S,
    ReplicaStats,
    health_exception_error,
    health_status_error,
    parse_vllm_metrics,
)
from router.schedule import Candidate
from router.schedule.observed import ObservedTTFT

log = logging.getLogger("prefix_router.fleet")

# What a replica does with a request (router/routing/plan.py): the whole of it (aggregated serving,
# the only role configured today), or one side of prefill/decode disaggregation.
Role = Literal["both", "prefill", "decode"]


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
    # Outlier detection (times on the fleet's clock). ``healthy`` is health_ok and not ejected.
    health_ok: bool = True  # the last /health answered 200
    health_error: str | None = None  # why the last /health failed, in words (None: it passed)
    ejected_at: float | None = None
    ejected_until: float | None = None
    ejection_reason: str | None = None  # "consecutive_failures" or "error_ratio"
    ejections: int = 0  # recent ejections: the next one lasts this + 1 times the base
    clean_since: float = 0.0  # in rotation since (or since the last forgiven ejection)
    spared_at: float | None = None  # last time the ejection cap kept it in (rate-limits a log)
    window: ErrorWindow = field(default_factory=lambda: ErrorWindow(10.0))
    latency: Latency = field(default_factory=Latency.new)
    # Time to first streamed byte of mostly cached requests (its wait), decayed; the gateway
    # feeds it (``RequestPath.learn``) and ring_spill's ttft cap reads it.
    ttft: ObservedTTFT = field(default_factory=ObservedTTFT)
    role: Role = "both"

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def outlier_state(self, now: float) -> dict[str, Any]:
        """What explain / diagnostics show about this replica's passive health."""
        outcomes, errors = self.window.counts(now)
        return {
            "in_rotation": self.healthy,
            "health_ok": self.health_ok,
            "ejected": self.ejected,
            "ejection_reason": self.ejection_reason,
            "ejected_for_s": (
                round(max(0.0, self.ejected_until - now), 3)
                if self.ejected_until is not None
                else None
            ),
            "recent_ejections": self.ejections,
            "window_outcomes": outcomes,
            "window_errors": errors,
        }

    def has_model(self, model: str) -> bool:
        """Serves ``model`` (a base model or a loaded LoRA adapter), or has not said."""
        return not self.models_known or model in self.models or model in self.stats.lora_active

    @property
    def base_model(self) -> str | None:
        """The base model it serves (the first name, when it serves one under several)."""
        return min((m for m, parent in self.models.items() if parent is None), default=None)

    def candidate(
        self, matched_blocks: int, offloaded_blocks: int = 0, offload_weight: float = 1.0
    ) -> Candidate:
        stats = self.stats
        # Positional, in Candidate's field order: keywords cost a dict per call (4 per
        # decision). url, matched_blocks, inflight, pending_prefill_tokens, waiting,
        # running, kv_usage, ttft_s, offloaded_blocks, offload_weight.
        return Candidate(
            self.url,
            matched_blocks,
            self.inflight + self.remote_inflight,
            self.pending_prefill_tokens + self.remote_prefill_tokens,
            stats.waiting,
            stats.running,
            stats.kv_usage,
            self.ttft.get(),
            offloaded_blocks,
            offload_weight,
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
        outlier: OutlierPolicy | None = None,
        first_byte_timeout_s: float | None = None,
        first_byte_timeout_floor_s: float = 10.0,
        first_byte_timeout_factor: float = 3.0,
        upstream_headers: dict[str, str] | None = None,
        on_event: ChangeHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas: dict[str, Replica] = {}
        self.session = session
        self.health_interval_s = health_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.policy = outlier or OutlierPolicy(consecutive_failures=eject_after_failures)
        self.first_byte_ceiling_s = first_byte_timeout_s
        self.first_byte_floor_s = first_byte_timeout_floor_s
        self.first_byte_factor = first_byte_timeout_factor
        self.latency = Latency.new()  # the whole fleet's: for replicas with no history yet
        self.headers = upstream_headers or {}
        self.on_event = on_event
        self.clock = clock
        self._tasks: list[asyncio.Task[None]] = []
        self._ticks = 0
        for url in urls:
            self.replicas[url.rstrip("/")] = self._new_replica(url.rstrip("/"))

    def _new_replica(self, url: str, healthy: bool = True) -> Replica:
        return Replica(
            url,
            healthy=healthy,
            health_ok=healthy,
            clean_since=self.clock(),
            window=ErrorWindow(self.policy.window_s),
        )

    # -- membership -------------------------------------------------------------------------
    async def set_urls(self, urls: Sequence[str], role: Role | None = None) -> None:
        """Replace the membership (DNS discovery); new replicas are probed before use.
        ``role``: replace only the replicas of that role (one DNS name per role), the new
        ones taking it."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.replicas):
            if url not in wanted and (role is None or self.replicas[url].role == role):
                replica = self.replicas.pop(url)
                log.info("replica removed: %s", url)
                await self._emit(replica, "removed")
        new = [self._new_replica(u, healthy=False) for u in sorted(wanted - set(self.replicas))]
        for replica in new:
            if role is not None:
                replica.role = role
            self.replicas[replica.url] = replica
            log.info("replica added: %s", replica.url)
        await asyncio.gather(*(self._probe(r) for r in new))

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def serving(self, model: str) -> list[Replica]:
        """Healthy replicas that serve ``model`` (or have not told us what they serve)."""
        return [r for r in self.replicas.values() if r.healthy and r.has_model(model)]

    def serves(self, model: str) -> bool:
        """``bool(serving(model))``, from the first such replica on."""
        for r in self.replicas.values():  # noqa: SIM110 - a loop: no generator per request
            if r.healthy and r.has_model(model):
                return True
        return False

    def models(self) -> dict[str, dict[str, Any]]:
        """The union of the healthy replicas' model cards."""
        return {k: v for r in self.healthy() for k, v in r.cards.items()}

    def card(self, model: str) -> dict[str, Any] | None:
        """``models().get(model)`` without building the union (asked on every request)."""
        found = None
        for r in self.replicas.values():
            if r.healthy:
                found = r.cards.get(model, found)
        return found

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

    def model_groups(self) -> dict[str, set[str]]:
        """Base model -> the replicas that report serving it (one ring each)."""
        groups: dict[str, set[str]] = {}
        for r in self.replicas.values():
            for model, parent in r.models.items():
                if parent is None:
                    groups.setdefault(model, set()).add(r.url)
        return groups

    def model_of(self, url: str) -> str | None:
        """The base model ``url`` serves, None when unknown (its fleet-mode index keys)."""
        r = self.replicas.get(url)
        return r.base_model if r is not None else None

    # -- passive health ---------------------------------------------------------------------
    async def record_failure(self, replica: Replica, why: str) -> None:
        """No answer before the first byte: connect error, 502/503, timeout, closed."""
        replica.failures += 1
        replica.window.add(self.clock(), True)
        await self._judge(replica, why)

    async def record_response(
        self,
        replica: Replica,
        status: int,
        *,
        stream: bool = False,
        first_byte_s: float | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """An answer reached the client: a 5xx is the replica's error, anything else a
        success (a 4xx is the client's fault). Successes teach the first-byte estimate."""
        error = status >= 500
        replica.window.add(self.clock(), error)
        if error:
            replica.failures += 1
            await self._judge(replica, f"HTTP {status}")
            return
        replica.failures = 0
        if status < 400 and first_byte_s is not None:
            replica.latency.observe(stream, first_byte_s, completion_tokens)
            self.latency.observe(stream, first_byte_s, completion_tokens)

    async def _judge(self, replica: Replica, why: str) -> None:
        if not replica.healthy:
            return  # already out of rotation
        outcomes, errors = replica.window.counts(self.clock())
        if replica.failures >= self.policy.consecutive_failures:
            reason, detail = "consecutive_failures", f"{replica.failures} failures in a row"
        elif outcomes >= self.policy.min_requests and errors > self.policy.error_ratio * outcomes:
            reason, detail = "error_ratio", f"{errors} errors in {outcomes} requests"
        else:
            return
        now = self.clock()
        if not self._may_eject(replica):
            if replica.spared_at is None or now - replica.spared_at >= self.policy.window_s:
                replica.spared_at = now
                log.warning(
                    "replica %s is failing (%s; last: %s) but stays in rotation: ejecting "
                    "it would exceed max_ejected_percent or leave no replica",
                    replica.url,
                    detail,
                    why,
                )
            return
        replica.ejections += 1
        duration = self.policy.ejection_s(replica.ejections)
        replica.healthy = False
        replica.ejected_at, replica.ejected_until = now, now + duration
        replica.ejection_reason = reason
        replica.failures = 0
        replica.window.clear()
        log.warning(
            "replica %s ejected for %.1f s (%s; last: %s; ejection %d)",
            replica.url,
            duration,
            detail,
            why,
            replica.ejections,
        )
        await self._emit(replica, "ejected")

    def _may_eject(self, replica: Replica) -> bool:
        """At most ``max_ejected_percent`` of the fleet ejected at once, and never the last
        replica in rotation: a fleet that fails everywhere still answers (with the replicas'
        own errors) instead of refusing everything."""
        ejected = sum(1 for r in self.replicas.values() if r.ejected)
        in_rotation = sum(1 for r in self.replicas.values() if r.healthy and r is not replica)
        return in_rotation > 0 and ejected < self.policy.max_ejected(len(self.replicas))

    async def expire_ejections(self) -> None:
        """Readmit replicas whose ejection is over (if their /health answers), and forgive
        one recent ejection of a replica that stayed in rotation ``decay_s``."""
        now = self.clock()
        for replica in list(self.replicas.values()):
            if replica.ejected_until is not None and now >= replica.ejected_until:
                replica.ejected_at = replica.ejected_until = None
                replica.clean_since = now
                if replica.health_ok:
                    replica.healthy = True
                    replica.failures = 0
                    replica.window.clear()
                    log.info("replica %s readmitted after its ejection", replica.url)
                    await self._emit(replica, "healthy")
            elif (
                replica.healthy
                and replica.ejections > 0
                and now - replica.clean_since >= self.policy.decay_s
            ):
                replica.ejections -= 1
                replica.clean_since = now
                if replica.ejections == 0:
                    replica.ejection_reason = None

    def first_byte_timeout(
        self, replica: Replica, stream: bool, max_tokens: int | None
    ) -> float | None:
        """How long to wait for this request's response headers: ``factor`` x what this
        replica usually takes (what the fleet takes, while it has too little history),
        clamped to [floor, ceiling]; the ceiling when nothing is known."""
        ceiling = self.first_byte_ceiling_s
        expected = replica.latency.expected(stream, max_tokens)
        if expected is None:
            expected = self.latency.expected(stream, max_tokens)
        if expected is None:
            return ceiling
        derived = max(self.first_byte_floor_s, self.first_byte_factor * expected)
        return derived if ceiling is None else min(ceiling, derived)

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
            await self.check_health()

    async def check_health(self) -> None:
        """One round: every replica's /health, then the ejections that are over."""
        await asyncio.gather(*(self._check_health(r) for r in list(self.replicas.values())))
        await self.expire_ejections()

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            self._ticks += 1
            healthy = self.healthy()
            await asyncio.gather(*(self._scrape(r) for r in healthy))
            # Every 30 ticks; a replica whose /v1/models has not answered yet, every tick
            # (the gateway is not ready, and refuses unknown names, until one has).
            due = healthy if self._ticks % 30 == 0 else [r for r in healthy if not r.models_known]
            await asyncio.gather(*(self._fetch_models(r) for r in due))

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
            async with await self._get(replica, "/health", HEALTH_TIMEOUT_S) as resp:
                error = health_status_error(resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            error = health_exception_error(e)
        ok = error is None
        changed = error != replica.health_error
        replica.health_ok, replica.health_error = ok, error
        if ok and not replica.healthy and not replica.ejected:  # ejected: wait its time out
            replica.healthy, replica.failures = True, 0
            replica.clean_since = self.clock()
            log.info("replica %s healthy", replica.url)
            await self._emit(replica, "healthy")
            await asyncio.gather(self._scrape(replica), self._fetch_models(replica))
        elif not ok and replica.healthy:
            replica.healthy = False
            log.warning("replica %s failed its health check: %s", replica.url, error)
            await self._emit(replica, "unhealthy")
        elif not ok and changed:  # still out of rotation, for another reason now
            log.info("replica %s still failing its health check: %s", replica.url, error)

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
        await self._emit(replica, "models")

    async def _emit(self, replica: Replica, event: str) -> None:
        if self.on_event is not None:
            await self.on_event(replica, event)
