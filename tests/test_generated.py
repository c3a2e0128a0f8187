"""Generated blocks over real sockets: after an answer the gateway records what the replica
caches (the prompt's and the answer's full blocks), so a conversation's next turn is
predicted as the replica reports it, streamed or not."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.families import MODELS, family_dir
from tests.helpers import cached_tokens, post

QWEN = "Qwen/Qwen3-0.6B"


def _turn(
    model: str, messages: list[dict[str, str]], stream: bool, limited: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if limited:
        body["max_tokens"] = 37  # finish_reason length; else stop after the default
    return body


async def _send(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], block_size: int
) -> tuple[int, int, str]:
    """(predicted, reported cached tokens, the answer's text)."""
    status, headers, answer = await post(s, url + "/v1/chat/completions", body)
    assert status == 200
    predicted = int(headers["x-prefix-router-cached-blocks"]) * block_size
    if not body["stream"]:
        return predicted, cached_tokens(answer), answer["choices"][0]["message"]["content"]
    text, reported = "", 0
    for line in answer.decode().split("\n\n"):
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        for c in chunk.get("choices") or ():
            text += (c.get("delta") or {}).get("content") or ""
        if chunk.get("usage"):
            reported = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return predicted, reported, text


@pytest.mark.parametrize(
    ("family", "stream", "limited"),
    [
        ("qwen3", False, False),
        ("qwen3", False, True),
        ("qwen3", True, False),
        ("qwen3", True, True),
        ("llama3", True, False),
        ("deepseek_v3", False, True),
    ],
)
async def test_later_turns_are_predicted_as_the_replica_reports(
    fleet: Any, gateway: Any, family: str, stream: bool, limited: bool
) -> None:
    if family == "qwen3":
        model, bs, extra = QWEN, 16, {}
    else:
        model, bs = MODELS[family], 32
        extra = {"tokenizer": str(family_dir(family)), "block_size": bs, "model": model}
    replicas = await fleet(2, max_tokens_default=45, **extra)
    models = {model: {"tokenizer": extra["tokenizer"]}} if extra else {}
    gw = await gateway([r.url for r in replicas], models=models)
    messages = [
        {"role": "system", "content": "You answer in plain words. " * 12},
        {"role": "user", "content": "Tell me about caches."},
    ]
    async with aiohttp.ClientSession() as s:
        for turn in range(4):
            body = _turn(model, messages, stream, limited)
            predicted, reported, text = await _send(s, gw.url, body, bs)
            if turn:
                assert predicted == reported, (turn, predicted, reported)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And then, part {turn}?"},
            ]
