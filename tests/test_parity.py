"""The parity probe over real sockets: a gateway compares its own tokenization of a fixed set
of probe requests with each replica's /tokenize (the simulator renders with its own code, as
vLLM does), at start-up and when a model's replicas change."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sim.vllm_chat import load_tokenizer
from router.models import tokenizers
from tests.families import family_dir
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


# Phi-3's chat template (microsoft/Phi-3.5-mini-instruct's tokenizer_config.json).
PHI3 = "microsoft/Phi-3.5-mini-instruct"
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def phi3_folder(tmp_path: Path, with_config: bool) -> Path:
    """Phi-3's tokenizer files (a package registry's copy), with or without the model's
    config.json beside them."""
    src = family_dir("phi3")
    d = tmp_path / ("model" if with_config else "tokenizer-only")
    d.mkdir()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = PHI3_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    if with_config:
        shutil.copy(src / "config.json", d / "config.json")
    return d


def test_phi3_class_follows_config_json_and_its_absence_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers picks another class for Phi-3's files with and without config.json; the
    gateway loads the model directory as vLLM does (the same class as the simulator's own
    loading), and a folder without config.json gets one line that names it."""
    model, bare = phi3_folder(tmp_path, True), phi3_folder(tmp_path, False)
    vllm_class = type(load_tokenizer(str(model))).__name__
    with_config = tokenizers.load(tokenizers.Found(str(model), "config"))
    assert type(with_config.tokenizer).__name__ == vllm_class
    assert not [r for r in caplog.records if "config.json" in r.getMessage()]
    without = tokenizers.load(tokenizers.Found(str(bare), "config"))
    assert type(without.tokenizer).__name__ != vllm_class
    text = " leading space"
    assert without.tokenizer.encode(text) != with_config.tokenizer.encode(text)
    (line,) = [r.getMessage() for r in caplog.records if "config.json" in r.getMessage()]
    assert str(bare) in line and "no config.json" in line


@pytest.mark.parametrize("with_config", [True, False])
async def test_phi3_without_config_json_fails_the_probe(
    fleet: Any, gateway: Any, tmp_path: Path, with_config: bool
) -> None:
    """The replica loads the model directory (config.json included), as vLLM does; the
    gateway is given the tokenizer files with or without it."""
    model = phi3_folder(tmp_path, True)
    given = model if with_config else phi3_folder(tmp_path, False)
    (replica,) = await fleet(1, model=PHI3, tokenizer=str(model))
    gw = await gateway([replica.url], models={PHI3: {"tokenizer": str(given)}})
    entry = (await _ready(gw.url))["models"][PHI3]
    if with_config:
        assert entry["parity"] == "exact" and entry["basis"] == "tokens"
    else:
        assert entry["parity"] == "mismatch" and entry["basis"] == "text_prefix"
