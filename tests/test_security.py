"""Cross-tenant side channels and resource holding, as a hostile tenant would try them: the
tokenizer's cache timed across tenants, bodies held open without a key, one request stalling
everyone, and secrets in config dumps or logs."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from router.config import dump_yaml, load_config
from router.core.bundled import tokenizer_dir
from router.prompt import Renderer
from router.prompt.fast_encode import ENV as FAST_TOKENIZER_ENV
from tests.helpers import chat_body, post, wait_for


@pytest.fixture(scope="session")  # as conftest's, which it overrides in this module
def renderer() -> Renderer:
    """The gateway's renderer with the reference BPE: the timing tests below need a miss
    that costs what Hugging Face's encode costs (an optional faster encoder, when
    installed, narrows the gap they measure; the scoping they test is the same)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAST_TOKENIZER_ENV, "0")
        return Renderer.from_pretrained(str(tokenizer_dir()))


KEYS = {"acme": "sk-acme-1f2e3d4c5b6a79880716", "globex": "sk-globex-9a8b7c6d5e4f3a2b1c0d"}
SECRET = "salt-secret-0a1b2c3d4e5f60718293"
WORDS = [
    "invoice",
    "ledger",
    "quarterly",
    "audit",
    "balance",
    "escrow",
    "merger",
    "tariff",
    "dividend",
    "clause",
    "annex",
    "warranty",
    "liability",
    "premium",
    "deposit",
    "payroll",
    "pension",
    "subsidy",
    "royalty",
    "lease",
]


def keys_file(path: Path, **tenant_overrides: dict[str, Any]) -> Path:
    tenants = {t: {"keys": [k], **tenant_overrides.get(t, {})} for t, k in KEYS.items()}
    path.write_text(yaml.safe_dump({"salt_secrets": SECRET, "tenants": tenants}))
    return path


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def private_document(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS) + str(rng.randrange(10_000))
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


async def _prepare_cpu(gw: Any, body: dict[str, Any], tenant: str) -> float:
    """Process CPU seconds the gateway spends preparing (parse, salt, tokenize, hash) one
    request of ``tenant``: what a client can time from outside."""
    raw = json.dumps(body).encode()
    t0 = time.process_time()
    await gw.gateway.path.prepare(raw, bearer(tenant), "chat", "timing")
    return time.process_time() - t0


async def _timing_trials(gw: Any, trials: int) -> tuple[float, float, float]:
    """Medians of (first sight, another tenant right after, the same tenant again)."""
    rng = random.Random(20261203)
    cold, other, same = [], [], []
    for _ in range(trials):
        doc = private_document(rng, 28_000)
        body = chat_body(doc, system="Summarise the attached contract.")
        cold.append(await _prepare_cpu(gw, body, "acme"))
        other.append(await _prepare_cpu(gw, body, "globex"))
        same.append(await _prepare_cpu(gw, body, "acme"))
    return statistics.median(cold), statistics.median(other), statistics.median(same)


async def test_tokenizer_cache_cannot_be_timed_across_tenants(tmp_path, fleet, gateway):
    """CVE-2025-46570's side channel, one layer up: the segment cache is scoped by salt, so
    another tenant's copy of a document is a miss (as on the replicas), never a fast hit."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], auth=True, api_keys_file=str(keys_file(tmp_path / "k.yaml"))
    )
    cold, other, same = await _timing_trials(gw, trials=9)
    # A repeat within one scope is a cache hit: the channel would be wide open (~15x).
    assert same * 4 < cold, (cold, other, same)
    # Another tenant sees the cost of a first sight, not of a hit.
    assert other > cold / 2, (cold, other, same)
    assert other > same * 3, (cold, other, same)


async def test_shared_scope_still_shares_where_policy_allows(tmp_path, fleet, gateway):
    """Under salt_policy none both tenants are one scope (as on the replicas): sharing the
    segment cache there leaks nothing the replicas' cache does not."""
    replicas = await fleet(1)
    path = keys_file(
        tmp_path / "k.yaml", acme={"salt_policy": "none"}, globex={"salt_policy": "none"}
    )
    gw = await gateway([replicas[0].url], auth=True, api_keys_file=str(path))
    cold, other, same = await _timing_trials(gw, trials=5)
    assert other * 4 < cold, (cold, other, same)


async def test_unknown_model_is_refused_before_tokenizing(tmp_path, fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], auth=True, api_keys_file=str(keys_file(tmp_path / "k.yaml"))
    )
    renderer = gw.gateway.renderer
    url = gw.url + "/v1/chat/completions"
    body = chat_body(private_document(random.Random(7), 20_000), model="no-such-model")
    before = renderer.cache_info()
    async with aiohttp.ClientSession() as s:
        status, _, answer = await post(s, url, body, bearer("acme"))
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    after = renderer.cache_info()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


# -- bodies held open ----------------------------------------------------------------------


async def _open_body(port: int, length: int, sent: int, headers: str = "") -> Any:
    """A connection that sends its headers and ``sent`` of ``length`` body bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
            f"\r\nContent-Length: {length}\r\n{headers}\r\n"
        ).encode()
        + b" " * sent
    )
    await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(head.split(b" ", 2)[1])
    rest = await asyncio.wait_for(reader.read(), 10)  # to EOF: the gateway closes
    return status, rest


async def test_no_key_is_refused_before_the_body_is_read(tmp_path, fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], auth=True, api_keys_file=str(keys_file(tmp_path / "k.yaml"))
    )
    port = int(gw.url.rsplit(":", 1)[1])
    conns = [await _open_body(port, 30_000_000, 1 << 20) for _ in range(5)]
    for reader, writer in conns:
        # Answered with most of the body never sent, and the connection closed after it.
        status, rest = await _answer(reader)
        assert status == 401 and b"invalid_api_key" in rest
        writer.close()
    assert gw.gateway.receiving_bytes == 0


async def test_slow_body_times_out_and_bytes_in_flight_are_bounded(tmp_path, fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        auth=True,
        api_keys_file=str(keys_file(tmp_path / "k.yaml")),
        max_body_bytes=1_000_000,
        max_inflight_body_bytes=2_000_000,
        client_share=1.0,  # the total alone (tests/test_fair_shares.py: the shares)
        body_timeout_s=1.0,
    )
    port = int(gw.url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {KEYS['acme']}\r\n"
    # Bytes count as they arrive: two bodies that sent 900,000 of their 900,001 bytes.
    slow = [await _open_body(port, 900_001, 900_000, auth) for _ in range(2)]

    async def both_received() -> bool:
        return gw.gateway.receiving_bytes == 1_800_000

    await wait_for(both_received, what="two bodies being received")
    reader, writer = await _open_body(port, 900_000, 1000, auth)
    status, rest = await _answer(reader)
    assert status == 503 and b"overloaded" in rest  # beyond the in-flight byte budget
    writer.close()
    for reader, writer in slow:
        status, rest = await _answer(reader)  # the body never completes: 408, closed
        assert status == 408 and b"body_timeout" in rest
        writer.close()
    assert gw.gateway.receiving_bytes == 0
    # A body declared larger than the limit is refused on its headers alone.
    reader, writer = await _open_body(port, 5_000_000, 10, auth)
    status, rest = await _answer(reader)
    assert status == 413
    writer.close()
    async with aiohttp.ClientSession() as s:  # and the gateway serves on
        assert (await post(s, gw.url + "/v1/chat/completions", chat_body("hi"), bearer("acme")))[
            0
        ] == 200


# -- one request must not stall everyone -----------------------------------------------------


async def test_health_answers_while_a_large_body_is_processed(tmp_path, fleet, gateway):
    """A large body (15,000 empty turns and 100,000 more values: seconds of parsing,
    normalising and rendering in pure Python, then refused as too long) is checked in the
    checking child, then prepared in a worker thread, and /health is answered while that
    thread holds it. Before, all of it ran on the event loop and /health waited for the
    whole request. The preparation is held in its thread until the probes are answered
    (events, not time)."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        auth=True,
        api_keys_file=str(keys_file(tmp_path / "k.yaml")),
        max_prompt_chars=500_000,
    )
    loop_thread = threading.current_thread()
    entered, release = threading.Event(), threading.Event()
    seen: list[threading.Thread] = []
    admit = gw.gateway.path._admit

    def held(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        if threading.current_thread() is not loop_thread:  # never block the loop itself
            entered.set()
            release.wait(60)
        return admit(*args, **kwargs)

    gw.gateway.path._admit = held
    big = chat_body("start", metadata={"values": [0] * 100_000})
    big["messages"].extend({"role": "user", "content": ""} for _ in range(15_000))
    url = gw.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(post(s, url, big, bearer("acme")))
        try:
            waiting = asyncio.ensure_future(asyncio.to_thread(entered.wait, 60))
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
            assert entered.is_set(), f"prepared on the event loop: {seen}"
            for _ in range(3):  # answered while the body is held in its thread
                async with s.get(gw.url + "/health") as resp:
                    assert resp.status == 200
            assert not task.done()
        finally:
            release.set()
        status, _, answer = await task
    assert status == 400 and answer["error"]["param"] in ("messages", "max_tokens"), answer
    assert seen and all(t is not loop_thread for t in seen), seen
    checks = gw.gateway.metrics.registry.get_sample_value
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) == 1


# -- secrets ---------------------------------------------------------------------------------


def test_print_config_masks_credentials_in_urls():
    config = load_config(
        None,
        env={},
        redis_url="redis://default:hunter2-redis@redis.internal:6379/0",
        replicas=["http://user:pw-replica@10.0.0.1:8000", "http://10.0.0.2:8000"],
        upstream_api_key="sk-upstream-abc",
        admin_key="admin-xyz",
    )
    text = dump_yaml(config)
    for secret in ("hunter2-redis", "pw-replica", "sk-upstream-abc", "admin-xyz"):
        assert secret not in text
    assert "redis://***@redis.internal:6379/0" in text
    assert "http://10.0.0.2:8000" in text
    assert (
        config.fleet.redis_url and "hunter2-redis" in config.fleet.redis_url
    )  # only the dump is masked


async def test_internal_error_logs_one_line(fleet, gateway, caplog, monkeypatch):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])

    def deep(*args: Any, **kwargs: Any) -> Any:
        def down(n: int) -> int:
            return down(n + 1)

        return down(0)

    monkeypatch.setattr(gw.gateway.path, "_admit", deep)
    caplog.set_level(logging.INFO, logger="prefix_router")
    async with aiohttp.ClientSession() as s:
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", chat_body("x"))
    assert status == 500 and answer["error"]["code"] == "internal_error"
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None
    assert "RecursionError" in failed[0].getMessage()
    assert len(failed[0].getMessage()) < 400


async def test_metrics_port_serves_metrics_without_a_key(tmp_path, fleet, gateway):
    """With auth on, /metrics on the main port is the admin's; the metrics_port listener is
    for a port only Prometheus reaches, and serves the same registry without a key."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        auth=True,
        api_keys_file=str(keys_file(tmp_path / "k.yaml")),
        metrics_port=metrics_port,
    )
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw.url + "/v1/chat/completions", chat_body("hi"), bearer("acme")))[
            0
        ] == 200
        async with s.get(gw.url + "/metrics") as resp:
            assert resp.status == 401
        async with s.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
            assert resp.status == 200
            assert 'prefix_router_tenant_requests_total{tenant="acme"}' in await resp.text()
        async with s.get(f"http://127.0.0.1:{metrics_port}/health") as resp:
            assert resp.status == 404  # metrics only
