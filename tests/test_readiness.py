"""Readiness, defined once (issue 39, items 5, 9 and 12): a gateway is ready when a healthy
replica has answered /v1/models and each of its models' tokenizers is loaded or declared
absent; an explicit tokenizer that cannot load stops it with one line; a load that fails
later is retried and shown in /ready; until some replica's model list is known, names no one
listed are refused and leave nothing behind; /ready's detail is the admin's. Over loopback
sockets against simulated replicas, some behind a tiny proxy that holds /v1/models back."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import string
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.config import load_config
from router.http.app import RunningGateway, start_gateway
from tests.conftest import TOKENIZER_DIR
from tests.helpers import cached_tokens, chat_body, post, wait_for
from tests.test_serve_start import ENV, free_port

QWEN = "Qwen/Qwen3-0.6B"


class HeldModels:
    """A proxy in front of a replica whose /v1/models answers 503 until ``release``: a vLLM
    that passes /health before its model list is served (or a slow one)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.released = asyncio.Event()
        self.session = aiohttp.ClientSession()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{bound}"

    def release(self) -> None:
        self.released.set()

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models" and not self.released.is_set():
            return web.json_response({"error": "not yet"}, status=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with self.session.request(
            request.method,
            self.target + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "application/json")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype})

    async def stop(self) -> None:
        await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def held() -> AsyncIterator[Callable[..., Awaitable[HeldModels]]]:
    made: list[HeldModels] = []

    async def make(target: str, port: int = 0) -> HeldModels:
        proxy = HeldModels(target)
        await proxy.start(port)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        await proxy.stop()


@pytest.fixture
async def plain_gateway() -> AsyncIterator[Callable[..., Awaitable[RunningGateway]]]:
    """A gateway that loads its own tokenizer (no renderer handed in), as ``serve`` does."""
    started: list[RunningGateway] = []

    async def start(urls: list[str], **overrides: Any) -> RunningGateway:
        overrides.setdefault("health_interval_s", 0.1)
        overrides.setdefault("metrics_interval_s", 0.1)
        running = await start_gateway(load_config(None, env={}, replicas=urls, **overrides), port=0)
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


async def get_ready(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready", headers=headers) as r:
        return r.status, await r.json()


async def ready_is(url: str, want: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await get_ready(url))[0] == want

    return check


async def test_started_before_its_replica_with_a_tokenizer_it_is_ready_only_when_exact(
    fleet, held, plain_gateway
) -> None:  # type: ignore[no-untyped-def]
    """Started before its replica (the usual order on Kubernetes) with --tokenizer: not ready
    while the replica is down, nor while it is healthy but its /v1/models has not answered;
    ready once it has and the tokenizer is in, and its first request is hashed with tokens
    (not the text fallback): the second one's predicted blocks are the replica's own count."""
    port = free_port()
    gw = await plain_gateway([f"http://127.0.0.1:{port}"], tokenizer=TOKENIZER_DIR)
    status, body = await get_ready(gw.url)
    assert status == 503 and "health check" in body["waiting_for"]

    (replica,) = await fleet(1)
    proxy = await held(replica.url, port)

    async def healthy() -> bool:
        return (await get_ready(gw.url))[1]["healthy_replicas"] == 1

    await wait_for(healthy, what="the replica to pass its health check")
    status, body = await get_ready(gw.url)
    assert status == 503, body  # healthy, but its models are not known
    assert "/v1/models" in body["waiting_for"]

    proxy.release()
    await wait_for(await ready_is(gw.url, 200), what="/ready to answer 200")
    status, body = await get_ready(gw.url)
    assert body["models"][QWEN]["basis"] == "tokens"
    assert body["models"][QWEN]["tokenizer_state"] == "loaded"
    async with aiohttp.ClientSession() as s:
        request = chat_body("the first request after ready")
        status, _, first = await post(s, gw.url + "/v1/chat/completions", request)
        assert status == 200, first
        status, headers, second = await post(s, gw.url + "/v1/chat/completions", request)
        assert status == 200, second
        async with s.get(gw.url + "/metrics") as resp:
            page = await resp.text()
    assert int(headers["x-prefix-router-cached-blocks"]) * 16 == cached_tokens(second) > 0
    assert 'basis="text_prefix"' not in page
    assert f'prefix_router_model_requests_total{{basis="tokens",model="{QWEN}"}} 2.0' in page


def _broken_tokenizer(where: Path) -> Path:
    where.mkdir()
    (where / "tokenizer.json").write_text("{this is not json")
    (where / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    return where


async def test_a_tokenizer_flag_that_cannot_load_is_exit_2_with_one_line(fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With its replica up (its model known at start-up), a --tokenizer whose files do not
    load stops `prefix-router serve` with one line naming it, instead of serving on the text
    fallback."""
    (replica,) = await fleet(1)
    broken = _broken_tokenizer(tmp_path / "tok")
    argv = [sys.executable, "-m", "router.cli", "serve", "--replica", replica.url]
    argv += ["--tokenizer", str(broken), "--port", str(free_port())]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("prefix-router serve: "), lines
    assert str(broken) in lines[0] and "cannot load" in lines[0]


async def test_a_model_found_later_whose_load_fails_is_retried_and_shown(
    fleet, gateway, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A second model joins after start-up with a configured tokenizer whose files do not
    load yet: /ready names it failed and retrying (the first model keeps the gateway ready),
    and once the files are whole the retry loads it; it is never the text fallback for life."""
    from loadtest.replica import SimConfig, SimReplica

    (first,) = await fleet(1)
    late_port = free_port()
    tok = _broken_tokenizer(tmp_path / "late-tok")
    gw = await gateway(
        [first.url, f"http://127.0.0.1:{late_port}"], models={"late-model": {"tokenizer": str(tok)}}
    )
    late = SimReplica(SimConfig(model="late-model"))
    await late.start(port=late_port)
    try:

        async def state() -> str | None:
            body = (await get_ready(gw.url))[1]
            return body.get("models", {}).get("late-model", {}).get("tokenizer_state")

        async def failed() -> bool:
            return await state() == "failed"

        await wait_for(failed, what="the late model's load to fail")
        status, body = await get_ready(gw.url)
        assert status == 200  # the first replica's model is loaded
        assert "cannot load" in body["models"]["late-model"]["missing_tokenizer"]
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(TOKENIZER_DIR) / name, tok / name)

        async def loaded() -> bool:
            return await state() == "loaded"

        await wait_for(loaded, timeout=20, what="the retry to load the late model's tokenizer")
        assert gw.gateway.models.entries["late-model"].basis == "tokens"
    finally:
        await late.stop()


async def test_unknown_names_before_any_model_list_leave_nothing_behind(
    fleet, held, gateway
) -> None:  # type: ignore[no-untyped-def]
    """1,500 random long model names while the only replica's /v1/models has not answered:
    each a 503 in the API's shape; /metrics names none of them and the registry holds no
    entry for them. Once the list is in, the served model is served and others are 404."""
    (replica,) = await fleet(1)
    proxy = await held(replica.url)
    gw = await gateway([proxy.url])
    rng = random.Random(9)
    names = ["".join(rng.choices(string.ascii_letters, k=200)) for _ in range(1500)]
    async with aiohttp.ClientSession() as s:
        for start in range(0, len(names), 100):
            answers = await asyncio.gather(
                *(
                    post(s, gw.url + "/v1/chat/completions", {**chat_body("hi"), "model": name})
                    for name in names[start : start + 100]
                )
            )
            for status, _, body in answers:
                assert status == 503, body
                assert body["error"]["code"] == "models_not_known"
        async with s.get(gw.url + "/metrics") as resp:
            page = await resp.text()
        assert not any(name in page for name in names)
        models = gw.gateway.models
        assert not models.entries and not models._offline
        assert len(page) < 200_000

        proxy.release()
        await wait_for(await ready_is(gw.url, 200), what="/ready to answer 200")
        status, _, body = await post(s, gw.url + "/v1/chat/completions", chat_body("hi"))
        assert status == 200, body
        status, _, body = await post(
            s, gw.url + "/v1/chat/completions", {**chat_body("hi"), "model": names[0]}
        )
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert set(gw.gateway.models.entries) == {QWEN}


async def test_ready_detail_is_the_admins(fleet, gateway, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With an admin key configured, /ready answers status and counts to anyone and what it
    waits for, model names, paths and errors only with the key; with auth on and no admin
    key, to no one."""
    (replica,) = await fleet(1)
    keys = tmp_path / "keys.yaml"
    table = {"tenants": {"a": {"keys": ["sk-a"]}}, "salt_secrets": [{"secret": "s" * 32}]}
    keys.write_text(json.dumps(table))
    gw = await gateway([replica.url], auth=True, api_keys_file=str(keys), admin_key="adm-secret")
    status, body = await get_ready(gw.url)
    assert status == 200
    assert set(body) == {
        "ready",
        "draining",
        "replicas",
        "healthy_replicas",
        "models_known_replicas",
        "model_count",
        "models_settled",
    }
    text = json.dumps(body)
    assert QWEN not in text and replica.url not in text and "/" not in text
    for headers in ({"Authorization": "Bearer sk-a"}, {"X-Admin-Key": "wrong"}):
        assert (await get_ready(gw.url, headers))[1] == body  # a tenant's key is no admin key
    status, detail = await get_ready(gw.url, {"X-Admin-Key": "adm-secret"})
    assert status == 200 and QWEN in detail["models"] and "waiting_for" in detail

    no_admin = await gateway([replica.url], auth=True, api_keys_file=str(keys))
    status, body = await get_ready(no_admin.url, {"Authorization": "Bearer sk-a"})
    assert status == 200 and "models" not in body and "waiting_for" not in body
