"""What a replica says about itself: its ``/metrics`` page read into the few ``vllm:*``
figures routing uses, and a failed ``/health`` check put in words for the operator."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import aiohttp

from router.telemetry import exposition


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
    hash_algo: str | None = None  # cache_config_info's prefix_caching_hash_algo
    # LoRA adapters with running or waiting requests (vllm:lora_requests_info)
    lora_active: frozenset[str] = frozenset()


def parse_vllm_metrics(text: str) -> ReplicaStats:
    """The few ``vllm:*`` samples routing reads, summed over engines. Tolerant of anything
    else on the page (only ``vllm:`` lines are matched: it runs every second)."""
    s = ReplicaStats()
    for name, raw_labels, v in exposition.samples(text, "vllm:"):
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
            kv = exposition.labels(raw_labels)
            with contextlib.suppress(KeyError, ValueError):
                s.block_size = int(kv["block_size"])
            with contextlib.suppress(KeyError, ValueError):
                s.num_gpu_blocks = int(kv["num_gpu_blocks"])
            s.hash_algo = kv.get("prefix_caching_hash_algo") or s.hash_algo
        elif name == "vllm:lora_requests_info":
            kv = exposition.labels(raw_labels)
            names = f"{kv.get('running_lora_adapters', '')},{kv.get('waiting_lora_adapters', '')}"
            s.lora_active |= {a for a in names.split(",") if a}
    return s


HEALTH_TIMEOUT_S = 3.0


def health_status_error(status: int) -> str | None:
    """Why a /health answer with this status takes a replica out of rotation (None: 200)."""
    if status == 200:
        return None
    if status == 404:
        return (
            "GET /health answered 404: a wrong path? the replica URL is vLLM's base URL "
            "(http://host:port), without /v1"
        )
    if status in (401, 403):
        return f"GET /health answered {status}: the replica wants a key (set upstream_api_key)"
    kind = "server error" if status >= 500 else "not 200"
    return f"GET /health answered {status} ({kind}; vLLM answers 503 while it loads or fails)"


def health_exception_error(e: BaseException) -> str:
    """Why a /health request failed, in words: refused, timed out, unresolvable, reset."""
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer to GET /health within {HEALTH_TIMEOUT_S:g} s (timeout)"
    if isinstance(e, aiohttp.ClientConnectorError):
        os_error = e.os_error
        if isinstance(os_error, socket.gaierror):
            return f"cannot resolve the host name ({os_error.strerror or os_error})"
        if isinstance(os_error, ConnectionRefusedError):
            return "connection refused (nothing listens on that host and port: not started yet?)"
        return f"cannot connect: {os_error.strerror or os_error}"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the connection closed before an answer (is it an HTTP server? https vs http?)"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"not an HTTP answer: {e.message}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
