"""One tenant cannot wipe what the gateway knows about a replica (issue 28, item 6): requests
vLLM serves without reading its prefix cache (prompt logprobs, asked for or through ``echo``)
report no cached tokens however much the replica holds; they are not evidence, and a reset of
a replica's index needs misses of several prompts from more than one tenant (or over time).
Over real sockets, with auth on and two tenants, against a simulated replica that skips the
cache read as vLLM does."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.helpers import LONG_SYSTEM, chat_body, post, wait_for

MODEL = "Qwen/Qwen3-0.6B"
KEYS = {"acme": "sk-acme-77aa55cc33ee11ff0099", "globex": "sk-globex-1122334455667788aabb"}
RESET = "resetting its index"


def _as(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def _start(tmp_path: Path, fleet: Any, gateway: Any) -> tuple[Any, Any]:
    keys = tmp_path / "keys.yaml"
    tenants = {t: {"keys": [k]} for t, k in KEYS.items()}
    keys.write_text(yaml.safe_dump({"salt_secrets": "k" * 32, "tenants": tenants}))
    (replica,) = await fleet(1)
    gw = await gateway([replica.url], auth=True, api_keys_file=str(keys), decision_headers=True)
    return replica, gw


async def _predicted(s: aiohttp.ClientSession, url: str, body: dict[str, Any], tenant: str) -> int:
    status, headers, answer = await post(s, url + "/v1/chat/completions", body, _as(tenant))
    assert status == 200, answer
    return int(headers["x-prefix-router-cached-blocks"])


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"prompt_logprobs": 1}),
        ("/v1/chat/completions", {"echo": True, "logprobs": True, "top_logprobs": 1}),
        ("/v1/completions", {"echo": True, "logprobs": 1}),
    ],
)
async def test_requests_that_skip_the_cache_read_reset_nothing(
    tmp_path, fleet, gateway, caplog, path, extra
):
    caplog.set_level(logging.INFO, logger="prefix_router")
    replica, gw = await _start(tmp_path, fleet, gateway)
    acme = chat_body("What is our refund policy?")
    globex_text = "Globex house rules. " * 40
    if path == "/v1/chat/completions":
        globex: dict[str, Any] = chat_body("Summarise", system=globex_text)
    else:
        globex = {"model": MODEL, "prompt": globex_text, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        await _predicted(s, gw.url, acme, "acme")
        before = await _predicted(s, gw.url, acme, "acme")
        assert before >= 10  # acme's prompt is known to be on the replica
        for _ in range(2):  # globex's own prompt, cached and predicted
            status, _, answer = await post(s, gw.url + path, globex, _as("globex"))
            assert status == 200, answer
        for _ in range(6):
            status, headers, answer = await post(
                s, gw.url + path, {**globex, **extra}, _as("globex")
            )
            assert status == 200, answer
            assert int(headers["x-prefix-router-cached-blocks"]) >= 2
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await _predicted(s, gw.url, acme, "acme") == before
    assert RESET not in caplog.text


async def test_a_lost_cache_is_still_forgotten_on_consistent_evidence(
    tmp_path, fleet, gateway, caplog
):
    caplog.set_level(logging.INFO, logger="prefix_router")
    replica, gw = await _start(tmp_path, fleet, gateway)
    prompts = [
        ("acme", chat_body("first question", system=LONG_SYSTEM)),
        ("globex", chat_body("other question", system="Globex rules. " * 40)),
        ("acme", chat_body("second question", system="ACME billing desk. " * 40)),
    ]
    async with aiohttp.ClientSession() as s:
        for tenant, body in prompts:
            await _predicted(s, gw.url, body, tenant)
        held = gw.gateway.index.size(replica.url)
        async with s.post(replica.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        # One miss is not evidence enough ...
        tenant, body = prompts[0]
        assert await _predicted(s, gw.url, body, tenant) > 0
        assert RESET not in caplog.text
        # ... misses of three prompts from two tenants are.
        for tenant, body in prompts[1:]:
            assert await _predicted(s, gw.url, body, tenant) > 0

        async def forgotten() -> bool:
            return gw.gateway.index.size(replica.url) < held

        await wait_for(forgotten, what="the replica's index reset")
    assert RESET in caplog.text
