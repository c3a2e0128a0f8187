"""What a starting gateway says: one summary block of what is on, "gateway ready" only when
/ready answers 200 (else what it waits for), and why a replica fails its health check."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import serve, wait_for
from tests.redis_server import RedisServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


async def get_ready(url: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return r.status, await r.json()


@pytest.fixture
async def status_server() -> AsyncIterator[str]:
    """An HTTP server whose /health answers 503 (a vLLM that is loading or failing)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503, text="loading")

    app = web.Application()
    app.router.add_get("/health", health)
    runner, url = await serve(app)
    yield url
    await runner.cleanup()


async def test_summary_says_what_is_on(fleet, gateway, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="prefix_router")
    (replica,) = await fleet(1)
    gw = await gateway([replica.url], block_size=16, policy="ttft")
    (block,) = [m for m in messages(caplog) if "listening on" in m]
    lines = block.splitlines()
    assert lines[0].endswith(f"listening on {gw.url}")
    settings = {line.split()[0]: line for line in lines[1:]}
    assert set(settings) >= {
        "replicas",
        "models",
        "tokenizer",
        "block",
        "policy",
        "fleet",
        "KV",
        "auth",
        "flow",
    }
    assert "1 (1 healthy)" in settings["replicas"]
    assert "Qwen/Qwen3-0.6B" in settings["models"]
    assert "16 (--block-size)" in settings["block"]
    assert "ttft" in settings["policy"]
    assert "off" in settings["fleet"] and "off" in settings["KV"] and "off" in settings["auth"]
    assert "off (default: one tenant" in settings["flow"]  # no auth, no tenant header
    ready = [m for m in messages(caplog) if m.startswith("gateway ready")]
    assert len(ready) == 1 and block in messages(caplog)[: messages(caplog).index(ready[0])]


async def test_summary_names_fleet_mode_and_where_the_block_size_came_from(  # type: ignore[no-untyped-def]
    fleet, gateway, redis_server: RedisServer, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router")
    (replica,) = await fleet(1, block_size=32)
    await gateway([replica.url], redis_url=redis_server.url)
    (block,) = [m for m in messages(caplog) if "listening on" in m]
    assert (
        f"on, {redis_server.url} (one Redis server), prefix 'prefix-router': Redis up; "
        "index in one hash per model, writes sent every 100 ms"
    ) in block
    assert "block size  32 (reported by the replicas in vllm:cache_config_info)" in block


async def test_no_gateway_ready_while_ready_is_503_and_the_reason_is_named(  # type: ignore[no-untyped-def]
    gateway, caplog
) -> None:
    """A replica not started yet: the log and /ready say connection refused, and "gateway
    ready" comes once it passes its health check, answers /v1/models and its model's
    tokenizer is loaded."""
    from loadtest.replica import SimConfig, SimReplica

    caplog.set_level(logging.INFO, logger="prefix_router")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = await gateway([url])
    assert not any(m.startswith("gateway ready") for m in messages(caplog))
    (failed,) = [m for m in messages(caplog) if "failed its health check" in m]
    assert url in failed and "connection refused" in failed
    (waiting,) = [m for m in messages(caplog) if m.startswith("gateway not ready yet")]
    assert "/ready answers 503" in waiting and "connection refused" in waiting
    status, body = await get_ready(gw.url)
    assert status == 503 and "connection refused" in body["waiting_for"]

    replica = SimReplica(SimConfig())
    await replica.start(port=port)
    try:

        async def announced() -> bool:
            return any(m.startswith("gateway ready") for m in messages(caplog))

        await wait_for(announced, what="gateway ready")
        (ready,) = [m for m in messages(caplog) if m.startswith("gateway ready")]
        # Ready once the replica answered /v1/models and its model's tokenizer is in.
        assert "model Qwen/Qwen3-0.6B: tokenizer loaded" in ready
        status, body = await get_ready(gw.url)
        assert status == 200 and body["waiting_for"] is None
    finally:
        await replica.stop()


async def test_health_check_reasons(fleet, gateway, status_server: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """A wrong path (the URL with a path prefix vLLM does not serve: a 404), a 5xx, and a
    listener that never answers: each failure says which."""
    caplog.set_level(logging.INFO, logger="prefix_router")
    (replica,) = await fleet(1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections in the kernel, never answers
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        gw = await gateway([replica.url + "/api", status_server, silent_url])
        errors = {url: r.health_error for url, r in gw.gateway.fleet.replicas.items()}
    finally:
        silent.close()
    assert "404" in errors[replica.url + "/api"] and "wrong path" in errors[replica.url + "/api"]
    assert "503" in errors[status_server] and "server error" in errors[status_server]
    assert "timeout" in errors[silent_url]
    logged = "\n".join(messages(caplog))
    for url, error in errors.items():
        assert f"replica {url} failed its health check: {error}" in logged


async def test_waiting_for_a_model_is_said_at_once_with_the_reason(caplog) -> None:  # type: ignore[no-untyped-def]
    """No --tokenizer and no replica up: start-up says at once that it waits, for what, and
    why the replica is not answering."""
    from router.config import load_config
    from router.http.app import start_gateway

    caplog.set_level(logging.INFO, logger="prefix_router")
    url = f"http://127.0.0.1:{free_port()}"
    config = load_config(None, env={}, replicas=[url], health_interval_s=0.1)
    starting = asyncio.create_task(start_gateway(config, port=0))

    async def waiting() -> bool:
        return any(m.startswith("waiting up to") for m in messages(caplog))

    await wait_for(waiting, what="the wait to be announced")
    (said,) = [m for m in messages(caplog) if m.startswith("waiting up to")]
    assert "/v1/models" in said and f"{url}: connection refused" in said
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting


async def test_summary_says_flow_control_is_on_by_default_with_tenants(  # type: ignore[no-untyped-def]
    fleet, gateway, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router")
    (replica,) = await fleet(1)
    gw = await gateway([replica.url], tenant_header="X-Tenant")
    (block,) = [m for m in messages(caplog) if "listening on" in m]
    (flow,) = [line for line in block.splitlines() if line.split()[0] == "flow"]
    assert "on (default)" in flow and "2048 uncached prompt tokens for a tenant alone" in flow
    assert gw.gateway.path.flow.config.enabled
