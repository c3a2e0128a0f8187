"""The two legs' bodies (router/disagg/legs.py) against the simulated NixlConnector: the
prefill leg as vLLM's proxy sends it, the prefill answer read per API, the decode leg pulling
exactly what it lacks; and the decision whether to split at all."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from loadtest.replica import SimReplica
from router.disagg import decision, legs
from router.intake.routed_request import Endpoint

MODEL = "Qwen/Qwen3-0.6B"
BS = 16
PROMPT = "Summarise the following report in three sentences. " * 20


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        return resp.status, await resp.read()


async def test_prefill_body_follows_vllms_proxy() -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "min_tokens": 3,
        "cache_salt": "tenant-a",
        "some_future_field": 1,
    }
    p = legs.prefill_body("chat", body)
    assert p["kv_transfer_params"] == legs.PREFILL_PARAMS
    assert p["stream"] is False and "stream_options" not in p and "min_tokens" not in p
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert p["return_token_ids"] is True
    assert p["cache_salt"] == "tenant-a" and p["some_future_field"] == 1
    assert body["stream"] is True and "kv_transfer_params" not in body  # the client's intact
    r = legs.prefill_body("responses", {"model": MODEL, "input": "hi", "max_output_tokens": 9})
    assert r["max_output_tokens"] == 1 and r["store"] is False and "return_token_ids" not in r
    m = legs.prefill_body("messages", {"model": MODEL, "messages": [], "max_tokens": 9})
    assert m["max_tokens"] == 1 and "return_token_ids" not in m


async def test_legs_drive_the_simulated_connector(
    fleet: Callable[..., Awaitable[list[SimReplica]]],
) -> None:
    p, d = await fleet(2, kv_connector="NixlConnector")
    cases: list[tuple[Endpoint, str, dict[str, Any]]] = [
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
        ("completions", "/v1/completions", {"prompt": PROMPT + " (completions)"}),
    ]
    for endpoint, path, body in cases:
        client = {"model": MODEL, "max_tokens": 5, **body}
        status, data = await _post(p.url + path, legs.prefill_body(endpoint, client))
        assert status == 200
        answer = legs.prefill_answer(endpoint, data)
        assert answer.params is not None and answer.params["remote_engine_id"]
        assert answer.prompt_token_ids is not None
        n = len(answer.prompt_token_ids)
        before = d.stats["pulled_blocks"]
        status, data = await _post(d.url + path, legs.decode_body(client, answer))
        assert status == 200
        assert json.loads(data)["choices"][0]["finish_reason"] == "length"
        assert d.stats["pulled_blocks"] - before == legs.pulled_blocks(n, BS, 0)
    assert d.stats["kv_corrupt_reads"] == d.stats["kv_load_failures"] == 0


async def test_a_prefill_answer_without_params_is_seen_as_such(
    fleet: Callable[..., Awaitable[list[SimReplica]]],
) -> None:
    (plain,) = await fleet(1)  # no KV connector: vLLM answers kv_transfer_params null
    client = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    status, data = await _post(
        plain.url + "/v1/chat/completions", legs.prefill_body("chat", client)
    )
    assert status == 200
    assert legs.prefill_answer("chat", data).params is None
    assert legs.prefill_answer("chat", b"not json").params is None


def test_loopback_side_channel() -> None:
    assert legs.loopback_side_channel({"remote_host": "localhost"}, "http://10.0.0.5:8000")
    assert not legs.loopback_side_channel({"remote_host": "localhost"}, "http://127.0.0.1:8000")
    assert not legs.loopback_side_channel({"remote_host": "10.0.0.5"}, "http://10.0.0.5:8000")


def test_skip_reason() -> None:
    t = decision.Thresholds(min_prompt_tokens=100, min_uncached_tokens=50)
    assert decision.skip_reason(99, 0, 1, t) == decision.SHORT_PROMPT
    assert decision.skip_reason(400, 360, 1, t) == decision.CACHED_ON_DECODE
    assert decision.skip_reason(400, 0, 2, t) == decision.SEVERAL_SEQUENCES
    assert decision.skip_reason(400, 300, 1, t) is None
