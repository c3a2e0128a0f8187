"""The opt-in start-up tokenizer download (router/models/download.py), over real sockets: a
local server speaking the Hugging Face Hub's file endpoints (``HEAD``/``GET
/<repo>/resolve/<revision>/<file>``, what huggingface_hub's ``hf_hub_download`` asks) stands
in for the Hub through ``HF_ENDPOINT``; the machine has no Hub access. A Llama 3 replica whose
tokenizer is on no path the gateway looks at, next to a Qwen3 one (bundled)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadtest.replica import SimConfig, SimReplica
from router.config import load_config
from router.http.app import RunningGateway, start_gateway
from router.ops.admin import SERVED_EXTENSIONS
from tests.families import MODELS, family_dir
from tests.helpers import LONG_SYSTEM, cached_tokens, post, serve

QWEN = "Qwen/Qwen3-0.6B"
LLAMA = MODELS["llama3"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The Hub's file endpoints for the repos it holds; records every request."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        filename = request.match_info["file"]
        headers = {"X-Repo-Commit": COMMIT}
        if repo not in self.repos:
            headers["X-Error-Code"] = "RepositoryNotFound"
            return web.Response(status=404, headers=headers, text="Repository not found")
        path = self.repos[repo] / filename
        if not path.is_file():
            headers["X-Error-Code"] = "EntryNotFound"
            return web.Response(status=404, headers=headers, text="Entry not found")
        data = path.read_bytes()
        headers["ETag"] = '"' + hashlib.sha1(data).hexdigest() + '"'
        return web.Response(body=data, headers=headers)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file}", self.resolve)
        self.runner, self.url = await serve(app)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    h = FakeHub({LLAMA: family_dir("llama3")})
    await h.start()
    yield h
    await h.stop()


@pytest.fixture
async def replicas() -> AsyncIterator[dict[str, SimReplica]]:
    rs = {
        QWEN: SimReplica(SimConfig(model=QWEN)),
        LLAMA: SimReplica(
            SimConfig(model=LLAMA, tokenizer=str(family_dir("llama3")), block_size=32)
        ),
    }
    for r in rs.values():
        await r.start()
    yield rs
    for r in rs.values():
        await r.stop()


async def gateway(rs: dict[str, SimReplica], **overrides: Any) -> RunningGateway:
    config = load_config(
        None,
        env={},
        replicas=sorted(r.url for r in rs.values()),
        health_interval_s=0.2,
        metrics_interval_s=0.2,
        **overrides,
    )
    return await start_gateway(config, port=0, extensions=SERVED_EXTENSIONS)


def body(user: str) -> dict[str, Any]:
    return {
        "model": LLAMA,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": user}],
    }


async def test_a_missing_tokenizer_is_downloaded_at_start_up_only_when_allowed(
    hub: FakeHub,
    replicas: dict[str, SimReplica],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    # Off (the default): nothing is asked of the Hub; the warning says how to allow it.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "off"))
    gw = await gateway(replicas)
    try:
        assert gw.gateway.models.entries[LLAMA].basis == "text_prefix"
    finally:
        await gw.stop()
    assert hub.requests == []
    assert any("tokenizer_download: true" in r.getMessage() for r in caplog.records)

    # Allowed, but HF_HUB_OFFLINE is set: still nothing, and the start-up line says why.
    caplog.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gw = await gateway(replicas, tokenizer_download=True)
    try:
        assert gw.gateway.models.entries[LLAMA].basis == "text_prefix"
    finally:
        await gw.stop()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub.requests == []
    lines = [r.getMessage() for r in caplog.records]
    assert any("HF_HUB_OFFLINE is set: nothing is downloaded" in m for m in lines), lines

    # Allowed: the start-up line names the endpoint and the cache; Llama's tokenizer files
    # (and nothing else, and not Qwen's: it is bundled) are fetched before serving, into the
    # cache; its requests are then predicted exactly, and no request reaches the Hub.
    caplog.clear()
    cache = tmp_path / "on"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    gw = await gateway(replicas, tokenizer_download=True)
    try:
        lines = [r.getMessage() for r in caplog.records]
        assert any(f"fetched from {hub.url} into {cache}" in m for m in lines), lines
        entry = gw.gateway.models.entries[LLAMA]
        assert entry.tokenizer_origin == "downloaded" and entry.basis == "tokens"
        assert entry.tokenizer is not None and entry.tokenizer.startswith(str(cache))
        assert gw.gateway.models.entries[QWEN].tokenizer_origin == "bundled"
        fetched = {p.rsplit("/", 1)[1] for m, p in hub.requests if m == "GET"}
        assert {"tokenizer.json", "tokenizer_config.json"} <= fetched
        assert all(p.startswith(f"/{LLAMA}/resolve/main/") for _, p in hub.requests)
        assert not any(f.endswith((".safetensors", ".bin", ".pt")) for f in fetched)
        before = len(hub.requests)
        async with aiohttp.ClientSession() as s:
            pairs = []
            for user in ("first question", "first question", "second question"):
                status, headers, answer = await post(s, gw.url + "/v1/chat/completions", body(user))
                assert status == 200, answer
                predicted = int(headers["x-prefix-router-cached-blocks"]) * 32
                pairs.append((predicted, cached_tokens(answer)))
        assert all(p == r for p, r in pairs) and pairs[1][0] > 0, pairs
        assert len(hub.requests) == before  # never on a request's path
    finally:
        await gw.stop()

    # A second start finds it in the cache: nothing is fetched again.
    hub.requests.clear()
    gw = await gateway(replicas, tokenizer_download=True)
    try:
        assert gw.gateway.models.entries[LLAMA].tokenizer_origin == "hf_cache"
    finally:
        await gw.stop()
    assert hub.requests == []


async def test_an_unreachable_endpoint_is_one_clear_line_and_the_text_prefix(
    replicas: dict[str, SimReplica],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with __import__("socket").socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    gw = await gateway(replicas, tokenizer_download=True)
    try:
        entry = gw.gateway.models.entries[LLAMA]
        assert entry.basis == "text_prefix"
        assert entry.missing is not None and "did not answer" in entry.missing
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([w for w in warnings if LLAMA in w]) == 1, warnings
    finally:
        await gw.stop()
