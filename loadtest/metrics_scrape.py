"""Read vLLM replicas' Prometheus ``/metrics``: prefix-cache counters, load gauges, cache config.

The fleet hit rate of a run is computed from the replicas' own counters, as deltas over the
run: ``sum(delta hits) / sum(delta queries)`` of ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` (tokens). Series are summed over label sets (``model_name``,
``engine``), so a data-parallel replica with several engines counts once per URL.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import aiohttp

from router.telemetry import exposition

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"

# The one parser of the page (router/telemetry/exposition.py), named as the load tests call it.
parse_prometheus = exposition.parse


def metrics_url(url: str) -> str:
    """A replica's base URL (``http://host:port``) or its metrics URL -> the metrics URL."""
    u = url.rstrip("/")
    return u if u.endswith("/metrics") else u + "/metrics"


def base_url(url: str) -> str:
    u = url.rstrip("/")
    return u[: -len("/metrics")] if u.endswith("/metrics") else u


@dataclass
class ReplicaMetrics:
    """One scrape of one replica."""

    url: str
    ok: bool = True
    error: str | None = None
    hits: float = 0.0
    queries: float = 0.0
    prompt_tokens: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    raw: dict[str, float] = field(default_factory=dict)


def from_text(url: str, text: str) -> ReplicaMetrics:
    series = parse_prometheus(text)

    def total(name: str) -> float:
        return sum(v for _, v in series.get(name, []) if math.isfinite(v))

    m = ReplicaMetrics(
        url,
        hits=total(HITS),
        queries=total(QUERIES),
        prompt_tokens=total(PROMPT_TOKENS),
        running=total(RUNNING),
        waiting=total(WAITING),
    )
    for labels, _ in series.get(CACHE_CONFIG, []):
        try:
            if "block_size" in labels:
                m.block_size = int(float(labels["block_size"]))
            if "num_gpu_blocks" in labels and labels["num_gpu_blocks"] not in ("", "None"):
                m.num_gpu_blocks = int(float(labels["num_gpu_blocks"]))
        except ValueError:
            pass
        break
    m.raw = {k: total(k) for k in (HITS, QUERIES, PROMPT_TOKENS, RUNNING, WAITING)}
    return m


async def scrape(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float = 5.0
) -> ReplicaMetrics:
    """Scrape one replica; failures come back as ``ok=False`` with the error, never raise."""
    try:
        async with session.get(
            metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            text = await resp.text()
            if resp.status != 200:
                return ReplicaMetrics(url, ok=False, error=f"HTTP {resp.status}")
            return from_text(url, text)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return ReplicaMetrics(url, ok=False, error=f"{type(e).__name__}: {e}")


async def gateway_counters(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float = 5.0
) -> dict[str, float] | None:
    """A gateway's placement counters: ``decisions:<reason>`` and ``spills:<cause>`` summed
    over policies (None when its /metrics cannot be read, e.g. auth on without the key)."""
    try:
        async with session.get(
            metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    out: dict[str, float] = {}
    page = parse_prometheus(text)
    for metric, label, kind in (
        ("prefix_router_decisions_total", "reason", "decisions"),
        ("prefix_router_spills_total", "cause", "spills"),
    ):
        for labels, value in page.get(metric, []):
            key = f"{kind}:{labels.get(label, '')}"
            out[key] = out.get(key, 0.0) + value
    # Reuse in the gateway's three numbers (docs/diagnostics.md), summed over models and
    # tenants: available - captured is what its routing left unused.
    for what in ("prompt", "available", "captured", "delivered"):
        metric = f"prefix_router_reuse_{what}_tokens_total"
        if metric in page:
            out[f"reuse:{what}"] = sum(value for _, value in page[metric])
    return out


async def scrape_all(
    urls: list[str],
    session: aiohttp.ClientSession | None = None,
) -> list[ReplicaMetrics]:
    if session is None:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(scrape(s, u) for u in urls)))
    return list(await asyncio.gather(*(scrape(session, u) for u in urls)))


@dataclass
class ReplicaDelta:
    """A replica's counters over a run (after - before)."""

    url: str
    ok: bool
    hits: float
    queries: float
    prompt_tokens: float
    error: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.ok and self.queries > 0 else None

    @property
    def prefilled_tokens(self) -> float:
        """Prompt tokens the replica actually computed (prompt tokens minus cache hits)."""
        return max(0.0, self.prompt_tokens - self.hits)


def delta(before: ReplicaMetrics, after: ReplicaMetrics) -> ReplicaDelta:
    ok = before.ok and after.ok
    err = before.error or after.error
    if not ok:
        return ReplicaDelta(
            after.url, False, 0.0, 0.0, 0.0, err, after.block_size, after.num_gpu_blocks
        )

    # a counter that went down means the replica restarted: count from zero
    def d(a: float, b: float) -> float:
        return a - b if a >= b else a

    return ReplicaDelta(
        after.url,
        True,
        d(after.hits, before.hits),
        d(after.queries, before.queries),
        d(after.prompt_tokens, before.prompt_tokens),
        None,
        after.block_size or before.block_size,
        after.num_gpu_blocks or before.num_gpu_blocks,
    )


def fleet_hit_rate(deltas: list[ReplicaDelta]) -> float | None:
    ok = [d for d in deltas if d.ok]
    q = sum(d.queries for d in ok)
    return sum(d.hits for d in ok) / q if q > 0 else None
