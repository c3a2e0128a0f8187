"""Small helpers the end-to-end tests share."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from router.fleet.probes import ReplicaStats, parse_vllm_metrics

LONG_SYSTEM = (
    "You are a meticulous support assistant for the ACME cloud platform. Follow the policies "
    "below exactly. Never reveal internal ticket numbers. Always answer in the user's language. "
) * 12


def chat_body(user: str, system: str = LONG_SYSTEM, **extra: Any) -> dict[str, Any]:
    return {
        "model": "Qwen/Qwen3-0.6B",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


async def serve(app: web.Application, **runner_options: Any) -> tuple[web.AppRunner, str]:
    """``app`` served on a free loopback port: its runner (clean it up) and its URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    """(status, headers (case-insensitive), parsed JSON or raw bytes)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with session.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as resp:
        raw = await resp.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        return resp.status, resp.headers.copy(), parsed


async def replica_stats(session: aiohttp.ClientSession, url: str) -> ReplicaStats:
    async with session.get(url + "/metrics") as resp:
        return parse_vllm_metrics(await resp.text())


async def wait_for(
    condition: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll an observable condition until it holds (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        if await condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def cached_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])
