"""Shared fixtures: the real Qwen3 tokenizer (loaded once), simulated replicas and gateways
on loopback sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from router.core.bundled import tokenizer_dir
from router.prompt import Renderer

TOKENIZER_DIR = str(tokenizer_dir())


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def renderer() -> Renderer:
    """The gateway's renderer (segment cache on)."""
    return Renderer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def reference_renderer(renderer: Renderer) -> Renderer:
    """Whole-prompt tokenization, as the simulated replicas do it."""
    return Renderer(renderer.tokenizer, segment_cache=False)


@pytest.fixture
async def fleet(reference_renderer: Renderer) -> AsyncIterator[Callable[..., Awaitable[list[Any]]]]:
    """``await fleet(n, **sim_config)`` starts n simulated replicas; all stop at teardown."""
    from loadtest.replica import SimConfig, SimReplica

    started: list[SimReplica] = []

    async def start(n: int, **overrides: Any) -> list[SimReplica]:
        out = []
        for _ in range(n):
            # The shared renderer is the bundled tokenizer's: not for another one.
            shared = reference_renderer if "tokenizer" not in overrides else None
            replica = SimReplica(SimConfig(**overrides), renderer=shared)
            await replica.start()
            started.append(replica)
            out.append(replica)
        return out

    yield start
    for replica in started:
        await replica.stop()


@pytest.fixture
async def gateway(renderer: Renderer) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """``await gateway(replica_urls, **config)`` starts a gateway on a free loopback port."""
    from router.config import load_config
    from router.http.app import RunningGateway, start_gateway
    from router.ops.admin import SERVED_EXTENSIONS

    started: list[RunningGateway] = []

    async def start(urls: list[str], **overrides: Any) -> RunningGateway:
        overrides.setdefault("health_interval_s", 0.2)
        overrides.setdefault("metrics_interval_s", 0.2)
        config = load_config(None, env={}, replicas=urls, **overrides)
        running = await start_gateway(
            config, renderer=renderer, port=0, extensions=SERVED_EXTENSIONS
        )
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


from tests.redis_server import redis_server_fixture  # noqa: E402, F401  (the redis_server fixture)
