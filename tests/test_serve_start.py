"""The first run: ``prefix-router replica`` + ``prefix-router serve --replica URL`` with no
other flag, an official OpenAI client through the gateway, start/drain/stop in the log, only
configured dependencies gauged, and one type for the error ``code``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from router.core.bundled import tokenizer_dir, tokenizer_for_model
from tests.helpers import chat_body, post

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_the_simulators_model_has_the_bundled_tokenizer() -> None:
    from loadtest.sim.config import SimConfig

    assert tokenizer_for_model(SimConfig().model) == tokenizer_dir()
    assert tokenizer_for_model("some/other-model") is None


def test_replica_and_serve_with_no_other_flags(procs: list[subprocess.Popen[str]]) -> None:
    """The README quickstart, verbatim but for the ports: the gateway finds the bundled
    tokenizer for the model the simulator reports, answers the official openai client, and
    logs its start, drain and stop on SIGTERM."""
    openai = pytest.importorskip("openai")
    replica = cli("replica", "--port", "0")
    procs.append(replica)
    assert replica.stdout is not None
    line = replica.stdout.readline()
    assert line.startswith("ready http://"), (line, replica.poll())
    replica_url = line.split()[1]

    port = free_port()
    gw = cli("serve", "--replica", replica_url, "--port", str(port))
    procs.append(gw)
    url = f"http://127.0.0.1:{port}"

    async def ready() -> str:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 120
            while gw.poll() is None and time.monotonic() < deadline:
                try:
                    async with s.get(url + "/ready") as r:
                        if r.status == 200:
                            async with s.get(url + "/metrics") as m:
                                return await m.text()
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"gateway not ready (exit {gw.poll()})")

    metrics = asyncio.run(ready())
    assert "prefix_router_requests" in metrics
    assert "prefix_router_redis_up" not in metrics  # no Redis configured: nothing to gauge

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    answer = client.chat.completions.create(
        model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > 0

    gw.send_signal(signal.SIGTERM)
    _, err = gw.communicate(timeout=60)
    assert gw.returncode == 0, err
    assert "model Qwen/Qwen3-0.6B: tokenizer from bundled" in err
    assert "gateway ready" in err
    assert "shutting down" in err and err.rstrip().endswith("stopped"), err
    assert "Traceback" not in err


async def test_error_code_is_a_string_or_null(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    """OpenAI sends ``code`` as a string or null; ours never switches to the status int."""
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    async with aiohttp.ClientSession() as s:
        answers = [
            await post(s, gw.url + "/v1/chat/completions", b"{not json"),
            await post(s, gw.url + "/v1/chat/completions", {"model": "m"}),
            await post(s, gw.url + "/v1/chat/completions", chat_body("hi", model="nope")),
        ]
    for status, _, body in answers:
        assert 400 <= status < 500, body
        code = body["error"]["code"]
        assert code is None or isinstance(code, str), body
    assert answers[2][2]["error"]["code"] == "model_not_found"


async def test_no_redis_gauge_without_redis(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert "prefix_router_requests" in text and "prefix_router_redis_up" not in text


async def test_serve_waits_for_a_replica_that_is_still_starting(caplog) -> None:  # type: ignore[no-untyped-def]
    """Started alongside its replicas (compose starts everything at once), a gateway with no
    --tokenizer waits for one to report its model instead of exiting."""
    from loadtest.replica import SimConfig, SimReplica
    from router.config import load_config
    from router.http.app import start_gateway
    from tests.helpers import chat_body, post, wait_for

    caplog.set_level(logging.INFO, logger="prefix_router")
    port = free_port()
    config = load_config(None, env={}, replicas=[f"http://127.0.0.1:{port}"], health_interval_s=0.1)
    starting = asyncio.create_task(start_gateway(config, port=0))

    async def waiting() -> bool:
        return any("waiting up to" in r.getMessage() for r in caplog.records)

    await wait_for(waiting, what="the gateway to wait for a model")
    assert not starting.done()
    replica = SimReplica(SimConfig())
    await replica.start(port=port)
    try:
        gw = await asyncio.wait_for(starting, 60)
        try:
            async with aiohttp.ClientSession() as s:
                status, _, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("hi"))
            assert status == 200
            assert gw.gateway.renderer is not None
        finally:
            await gw.stop()
    finally:
        await replica.stop()


async def test_metrics_carry_build_info_and_no_created_series(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    import platform

    from router import __version__

    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    async with aiohttp.ClientSession() as s:
        await post(s, gw.url + "/v1/chat/completions", chat_body("hi"))
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    build = f'prefix_router_build_info{{python="{platform.python_version()}",version="{__version__}"}} 1.0'
    assert build in text, text[:500]
    assert "prefix_router_requests_total{" in text
    assert not [line for line in text.splitlines() if "_created" in line.split("{")[0]]
