"""Multi-model fleets over real sockets: one gateway (and two on one Redis) in front of
simulated replicas of two tokenizer families (Qwen3 with block size 16, Llama 3 with block
size 32), a LoRA adapter, and a model whose tokenizer the gateway cannot find, started with no
tokenizer flags: each model's tokenizer comes from the bundled files or this host's Hugging
Face cache (router/models/)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.replica import SimConfig, SimReplica
from router.config import load_config
from router.core.bundled import tokenizer_dir
from router.http.app import RunningGateway, start_gateway
from router.index.redis import key_prefix, make_client
from router.ops.admin import SERVED_EXTENSIONS
from tests.families import MODELS, family_dir
from tests.helpers import LONG_SYSTEM, cached_tokens, post, wait_for
from tests.redis_server import RedisServer

QWEN = "Qwen/Qwen3-0.6B"
LLAMA = MODELS["llama3"]
MYSTERY = "org/mystery-7b"  # served with Qwen's files, which the gateway cannot find for it
ADAPTER = "sql-lora"
BLOCK = {QWEN: 16, LLAMA: 32, MYSTERY: 16}


def hf_cache(root: Path, repo: str, files: Path) -> Path:
    """A Hugging Face hub cache holding ``repo``'s tokenizer files, laid out as
    huggingface_hub lays it out (what a `huggingface-cli download` leaves)."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / "5f0b02c75b57c5855da9ae460ce51323ea669d8a"
    snap.mkdir(parents=True)
    for f in files.iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f.resolve())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(snap.name)
    return root


@dataclass
class Fleet:
    replicas: dict[str, list[SimReplica]] = field(default_factory=dict)  # model -> replicas

    def urls(self, model: str | None = None) -> set[str]:
        models = [model] if model else list(self.replicas)
        return {r.url for m in models for r in self.replicas[m]}

    def all(self) -> list[SimReplica]:
        return [r for rs in self.replicas.values() for r in rs]


@pytest.fixture
async def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    llama_dir = family_dir("llama3")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache(tmp_path / "hub", LLAMA, llama_dir)))
    monkeypatch.delenv("HF_HOME", raising=False)
    configs = {
        QWEN: [SimConfig(model=QWEN, lora_adapters=[ADAPTER]), SimConfig(model=QWEN)],
        LLAMA: [SimConfig(model=LLAMA, tokenizer=str(llama_dir), block_size=32)] * 2,
        MYSTERY: [SimConfig(model=MYSTERY, tokenizer=str(tokenizer_dir()))],
    }
    fleet = Fleet()
    try:
        for model, cfgs in configs.items():
            for cfg in cfgs:
                r = SimReplica(cfg)
                await r.start()
                fleet.replicas.setdefault(model, []).append(r)
        yield fleet
    finally:
        for r in fleet.all():
            await r.stop()


async def gateway(urls: set[str], **overrides: Any) -> RunningGateway:
    overrides.setdefault("health_interval_s", 0.2)
    overrides.setdefault("metrics_interval_s", 0.2)
    overrides.setdefault("replicas", sorted(urls))
    config = load_config(None, env={}, **overrides)
    # No tokenizer, no renderer handed in: the registry finds each model's.
    return await start_gateway(config, port=0, extensions=SERVED_EXTENSIONS)


def body(model: str, user: str, system: str = LONG_SYSTEM) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


async def send(
    s: aiohttp.ClientSession, gw: RunningGateway, b: dict[str, Any]
) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, reported cached tokens) of one request."""
    status, headers, answer = await post(s, gw.url + "/v1/chat/completions", b)
    assert status == 200, answer
    entry = gw.gateway.models.resolve(b["model"])
    assert entry is not None
    predicted = int(headers["x-prefix-router-cached-blocks"]) * entry.entry.block_size
    return headers["x-prefix-router-replica"], predicted, cached_tokens(answer)


async def conversation_rounds(
    s: aiohttp.ClientSession, gws: list[RunningGateway], model: str, fleet: Fleet
) -> list[tuple[int, int]]:
    """Shared system prompts and repeated questions, through the gateways in turn: every
    request reaches one of the model's own replicas; returns (predicted, reported) pairs."""
    pairs = []
    for i in range(6):
        system = f"Team {i % 2} of {model}. " + LONG_SYSTEM
        for user in (f"question {i}", f"question {i}", f"another question {i}"):
            gw = gws[len(pairs) % len(gws)]
            replica, predicted, reported = await send(s, gw, body(model, user, system))
            assert replica in fleet.urls(model), (model, replica)
            pairs.append((predicted, reported))
    return pairs


async def test_two_families_one_gateway(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router")
    gw = await gateway(fleet.urls(), model_aliases={"claude-3-5-haiku-latest": LLAMA})
    try:
        models = gw.gateway.models.entries
        assert models[QWEN].tokenizer_origin == "bundled" and models[QWEN].block_size == 16
        assert models[LLAMA].tokenizer_origin == "hf_cache" and models[LLAMA].block_size == 32
        assert models[MYSTERY].basis == "text_prefix"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert MYSTERY in warnings[0] and "models:" in warnings[0]  # how to give its tokenizer
        async with aiohttp.ClientSession() as s:
            for model in (QWEN, LLAMA):
                pairs = await conversation_rounds(s, [gw], model, fleet)
                assert all(p == r for p, r in pairs), (model, pairs)
                assert sum(1 for p, _ in pairs if p > 0) >= 12  # most requests hit
            # The adapter: only the replica that has it; its own chains (the base model's
            # prompt does not count for it), then predicted exactly.
            holder = fleet.replicas[QWEN][0].url
            b = body(ADAPTER, "question 0", f"Team 0 of {QWEN}. " + LONG_SYSTEM)
            assert await send(s, gw, b) == (holder, 0, 0)
            replica, predicted, reported = await send(s, gw, b)
            assert replica == holder and predicted == reported > 0
            # An alias reaches the served model (the replica knows no alias: it would 404).
            replica, _, _ = await send(
                s, gw, {**body(LLAMA, "hi"), "model": "claude-3-5-haiku-latest"}
            )
            assert replica in fleet.urls(LLAMA)
            # /tokenize reaches the body's model's replicas (another model's would 404).
            for _ in range(4):
                tb = {"model": "claude-3-5-haiku-latest", "prompt": "Hello"}
                status, _, tokens = await post(s, gw.url + "/tokenize", tb)
                assert status == 200 and tokens["tokens"][0] == 128000  # Llama 3's BOS
            # The model without a tokenizer: routed by its text prefix, labelled so.
            b = body(MYSTERY, "what now?")
            for _ in range(2):
                replica, _, _ = await send(s, gw, b)
                assert replica in fleet.urls(MYSTERY)
            status, _, explained = await post(s, gw.url + "/v1/route/explain", b)
            assert status == 200 and explained["model_match"]["basis"] == "text_prefix"
            assert explained["model_match"]["missing_tokenizer"]
            status, _, explained = await post(s, gw.url + "/v1/route/explain", body(LLAMA, "x"))
            assert explained["model_match"]["tokenizer_origin"] == "hf_cache"
            assert explained["block_size"] == 32
            async with s.get(gw.url + "/ready") as r:
                ready = await r.json()
            assert ready["models"][MYSTERY]["basis"] == "text_prefix"
            assert ready["models"][LLAMA]["block_size"] == 32
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
        assert (
            f'prefix_router_model_requests_total{{basis="text_prefix",model="{MYSTERY}"}} 2.0'
            in text
        )
        assert f'prefix_router_model_requests_total{{basis="tokens",model="{LLAMA}"}}' in text
        # Each replica saw only its model's requests.
        for model, replicas in fleet.replicas.items():
            for r in replicas:
                seen = {rec["model"] for rec in r.stats["records"]}
                assert seen <= {model, ADAPTER}, (model, seen)
    finally:
        await gw.stop()


async def test_fleet_mode_two_gateways_that_saw_the_models_in_other_orders(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    """Each model's index is its own in Redis (keys under the model's tag) and each model has
    its own ring, the same on every gateway whichever model it saw first: a gateway listing
    the Qwen replicas first and one listing the Llama replicas first share both models'
    indexes, and every request through either is predicted exactly."""
    qwen_first = sorted(fleet.urls(QWEN)) + sorted(fleet.urls(LLAMA)) + sorted(fleet.urls(MYSTERY))
    gws = [
        # A generous Redis timeout: a lookup that times out on a busy machine is answered
        # from the gateway's local view (by design), which has not seen the other's placement.
        await gateway(
            set(),
            replicas=urls,
            redis_url=redis_server.url,
            sync_interval_s=0.1,
            redis_timeout_ms=5000.0,
        )
        for urls in (qwen_first, qwen_first[::-1])
    ]
    try:
        rings = [gw.gateway.ring.models() for gw in gws]
        assert rings[0] == rings[1]
        for model in (QWEN, LLAMA):
            assert set(rings[0][model]) == fleet.urls(model)

        async def settled(b: dict[str, Any], replica: str) -> None:
            """Both gateways see the request's blocks on ``replica`` (its record is written
            to Redis off the request's path)."""
            for gw in gws:
                rr = await gw.gateway.path.prepare(json.dumps(b).encode(), {}, "chat", "t")

                async def held(gw: RunningGateway = gw, rr: Any = rr) -> bool:
                    got = await gw.gateway.index.match(rr.block_hashes, [replica])
                    return got.get(replica, 0) == len(rr.block_hashes)

                await wait_for(held, what=f"{b['model']}'s blocks in the shared index")

        async with aiohttp.ClientSession() as s:
            for model in (QWEN, LLAMA):
                pairs = []
                for i in range(12):
                    system = f"Team {i % 3} of {model}. " + LONG_SYSTEM
                    b = body(model, f"question {i // 2}", system)
                    replica, predicted, reported = await send(s, gws[i % 2], b)
                    assert replica in fleet.urls(model), (model, replica)
                    pairs.append((predicted, reported))
                    await settled(b, replica)
                assert all(p == r for p, r in pairs), (model, pairs)
                assert sum(1 for p, _ in pairs if p > 0) >= 6, (model, pairs)
        # Each model's blocks live under its own tag, for the replicas serving it.
        client = make_client(redis_server.url)
        try:
            keys = {k.decode() async for k in client.scan_iter("prefix-router:*:blocks:*")}
        finally:
            await client.aclose()
        for model in (QWEN, LLAMA):
            mine = {k for k in keys if k.startswith(key_prefix("prefix-router", model))}
            assert mine and {k.rsplit(":blocks:", 1)[1] for k in mine} <= fleet.urls(model)
        assert not [k for k in keys if "unknown-model" in k], keys
    finally:
        for gw in gws:
            await gw.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("how", ["flag", "models"])
async def test_a_contradicted_block_size_is_refused(tmp_path: Path, how: str) -> None:
    replica = SimReplica(SimConfig(block_size=16))
    await replica.start()
    try:
        args = ["serve", "--replica", replica.url, "--port", str(free_port())]
        if how == "flag":
            args += ["--block-size", "32"]
        else:
            cfg = tmp_path / "router.yaml"
            cfg.write_text(f"models:\n  {QWEN}:\n    block_size: 32\n")
            args += ["--config", str(cfg)]
        # The replica answers on this loop: the gateway runs beside it, as a user runs it.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router.cli",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            _, raw = await asyncio.wait_for(proc.communicate(), 120)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await replica.stop()
    err = raw.decode()
    assert proc.returncode not in (0, None), err
    refusal = [line for line in err.splitlines() if "contradicts" in line]
    assert len(refusal) == 1 and "report block size 16" in refusal[0], err
    assert "Traceback" not in err


async def test_an_adapter_no_replica_has_is_loaded_at_run_time(tmp_path: Path) -> None:
    replicas = [SimReplica(SimConfig(allow_runtime_lora=True)) for _ in range(2)]
    for r in replicas:
        await r.start()
    gw = await gateway(
        {r.url for r in replicas},
        models={QWEN: {"adapters": {"new-lora": "/adapters/new-lora"}}},
        lora_runtime_loading=True,
    )
    try:
        async with aiohttp.ClientSession() as s:
            b = body("new-lora", "hello adapter")
            status, _, explained = await post(s, gw.url + "/v1/route/explain", b)
            assert status == 200 and explained["adapter_load"]["adapter"] == "new-lora"
            assert all(r.stats.get("adapters_loaded", 0) == 0 for r in replicas)  # explain: no
            first, _, _ = await send(s, gw, b)
            loaded = [r for r in replicas if "new-lora" in r.config.lora_adapters]
            assert [r.url for r in loaded] == [first]  # loaded where the request went, once
            replica, predicted, reported = await send(s, gw, b)
            assert replica == first and predicted == reported > 0
            assert loaded[0].stats["adapters_loaded"] == 1
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
        assert 'prefix_router_lora_adapter_loads_total{adapter="new-lora",' in text
        assert 'outcome="ok"} 1.0' in text
    finally:
        await gw.stop()
        for r in replicas:
            await r.stop()


async def test_drift_is_reported_when_the_replicas_render_otherwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway is told a chat template the replicas do not use (a long constant head):
    it predicts a shared prefix the replicas never report, and says so. The parity probe
    would catch this template at start-up (tests/test_parity.py): off here, the drift watch is
    what remains for what a probe cannot see."""
    template = tmp_path / "wrong.jinja"
    template.write_text(
        "{{ 'This is not the template the replicas use. ' * 30 }}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    replica = SimReplica(SimConfig())
    await replica.start()
    gw = await gateway(
        {replica.url}, models={QWEN: {"chat_template": str(template)}}, parity_probe=False
    )
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(25):
                await send(s, gw, body(QWEN, f"question {i}", system=f"system {i}"))
            async with s.get(gw.url + "/ready") as r:
                ready = await r.json()
            status, _, explained = await post(s, gw.url + "/v1/route/explain", body(QWEN, "x"))
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
        assert ready["models"][QWEN]["drifting"] is True
        assert explained["model_match"]["drift"]["drifting"] is True
        assert f'prefix_router_model_drifting{{model="{QWEN}"}} 1.0' in text
        lines = [
            r.getMessage() for r in caplog.records if "predictions run above" in r.getMessage()
        ]
        assert len(lines) == 1 and QWEN in lines[0]
    finally:
        await gw.stop()
        await replica.stop()


async def test_replicas_of_one_model_that_disagree_are_kept_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router")
    replicas = [SimReplica(SimConfig(block_size=bs)) for bs in (16, 16, 32)]
    for r in replicas:
        await r.start()
    gw = await gateway({r.url for r in replicas})
    try:
        odd = replicas[2].url
        lines = [m for m in (r.getMessage() for r in caplog.records) if "disagree" in m]
        assert len(lines) == 1 and odd in lines[0] and "block size 32" in lines[0]
        entry = gw.gateway.models.entries[QWEN]
        assert entry.block_size == 16 and entry.apart == (odd,)
        async with aiohttp.ClientSession() as s:
            for i in range(8):
                replica, predicted, reported = await send(s, gw, body(QWEN, f"q{i % 2}"))
                assert replica != odd and predicted == reported
    finally:
        await gw.stop()
        for r in replicas:
            await r.stop()


async def test_diagnostics_decode_each_model_with_its_own_tokenizer(fleet: Fleet) -> None:
    """The live diagnostics show where each model's prompts diverge in that model's own text:
    Llama 3's token ids decoded with Llama 3's tokenizer (Qwen3's, the default model's, would
    turn them into other text), and no text at all for the model matched by its text prefix."""
    gw = await gateway(fleet.urls(), admin_key="k")
    try:
        async with aiohttp.ClientSession() as s:
            for model in (QWEN, LLAMA, MYSTERY):
                for i in range(4):
                    system = f"Current date and time: 2026-10-27T14:03:{i:02d}Z\n" + LONG_SYSTEM
                    await send(s, gw, body(model, "What changed?", system))
            reports = {}
            for model in (QWEN, LLAMA, MYSTERY):
                async with s.get(
                    gw.url + "/admin/diagnostics",
                    params={"model": model},
                    headers={"X-Admin-Key": "k"},
                ) as r:
                    assert r.status == 200
                    reports[model] = await r.json()
        for model in (QWEN, LLAMA):
            culprit = reports[model]["divergence"]["culprits"][0]
            assert "Current date and time: 2026-10-27T14:03:" in culprit["line"], (model, culprit)
        culprit = reports[MYSTERY]["divergence"]["culprits"][0]
        assert reports[MYSTERY]["scope"]["requests"] == 4
        assert "line" not in culprit and "before" not in culprit, culprit
        # Explain tokenizes each model's body with its own tokenizer too.
        async with aiohttp.ClientSession() as s:
            for model, first in ((LLAMA, 128000), (QWEN, None)):
                status, _, explained = await post(
                    s,
                    gw.url + "/v1/route/explain?token_ids=1",
                    body(model, "x"),
                    {"X-Admin-Key": "k"},
                )
                assert status == 200
                ids = explained["token_ids"]
                if first is not None:
                    assert ids[0] == first  # Llama 3's BOS
                else:
                    assert 128000 not in ids
    finally:
        await gw.stop()
