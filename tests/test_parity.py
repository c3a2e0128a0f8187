"""The parity probe over real sockets: a gateway compares its own tokenization of a fixed set
of probe requests with each replica's /tokenize (the simulator renders with its own code, as
vLLM does), at start-up and when a model's replicas change."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import post, wait_for

QWEN = "Qwen/Qwen3-0.6B"
# A template the gateway is not told about: what a replica started with --chat-template uses.
OTHER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = {
    "model": QWEN,
    "max_tokens": 2,
    "messages": [{"role": "system", "content": "S " * 40}, {"role": "user", "content": "hi"}],
}


async def _ready(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return dict(await r.json())


async def test_replicas_that_agree_are_probed_exact(fleet: Any, gateway: Any) -> None:
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    ready = await _ready(gw.url)
    assert ready["ready"] is True
    assert ready["models"][QWEN]["parity"] == "exact"
    assert ready["models"][QWEN]["basis"] == "tokens"
    # Both replicas answered every probe (five probes each).
    assert all(r.stats["errors"] == 0 for r in replicas)


async def test_a_replica_with_another_template_fails_the_probe_loudly(
    fleet: Any, gateway: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router")
    template = tmp_path / "other.jinja"
    template.write_text(OTHER_TEMPLATE)
    (replica,) = await fleet(1, chat_template=str(template))
    gw = await gateway([replica.url])
    ready = await _ready(gw.url)
    model = ready["models"][QWEN]
    assert ready["ready"] is True  # settled: routed by its labelled fallback
    assert model["parity"] == "mismatch" and model["basis"] == "text_prefix"
    assert "token " in model["parity_detail"] and replica.url in model["parity_detail"]
    lines = [r.getMessage() for r in caplog.records if "parity probe otherwise" in r.getMessage()]
    assert len(lines) == 1 and QWEN in lines[0] and "token " in lines[0]
    async with aiohttp.ClientSession() as s:
        status, _, explained = await post(s, gw.url + "/v1/route/explain", CHAT)
        assert status == 200
        assert explained["model_match"]["basis"] == "text_prefix"
        assert explained["model_match"]["parity"] == "mismatch"
        status, _, _ = await post(s, gw.url + "/v1/chat/completions", CHAT)
        assert status == 200
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert f'prefix_router_model_parity_mismatch{{model="{QWEN}"}} 1.0' in text
    assert f'prefix_router_model_requests_total{{basis="text_prefix",model="{QWEN}"}}' in text


async def test_a_new_replica_that_differs_is_probed_when_it_joins(
    fleet: Any, gateway: Any, tmp_path: Path
) -> None:
    (good,) = await fleet(1)
    gw = await gateway([good.url])
    assert (await _ready(gw.url))["models"][QWEN]["parity"] == "exact"
    template = tmp_path / "other.jinja"
    template.write_text(OTHER_TEMPLATE)
    (odd,) = await fleet(1, chat_template=str(template))
    await gw.gateway.fleet.set_urls([good.url, odd.url])  # as discovery does
    entry = gw.gateway.models.entries[QWEN]

    async def mismatched() -> bool:
        return entry.parity == "mismatch"

    await wait_for(mismatched, what="the new replica's probe")
    assert entry.basis == "text_prefix" and odd.url in (entry.parity_detail or "")
