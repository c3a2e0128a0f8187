"""/tokenize and /detokenize bodies are walked by router/intake/shapes.py like generation bodies
(issue 18): the replica renders and tokenizes them too, so the same hostile shapes get the
same 400 naming the field, from the gateway, before anything is forwarded."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.helpers import post

MODEL = "Qwen/Qwen3-0.6B"


def nested(depth: int) -> Any:
    leaf: Any = "x"
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def deep_nesting() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(700)}}],
    }


CASES = [
    pytest.param("/tokenize", deep_nesting, "nested_too_deeply", "tools[0]", id="deep tools"),
    pytest.param(
        "/tokenize",
        lambda: {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 30_000},
        "too_many_items",
        "messages",
        id="30k messages",
    ),
    pytest.param(
        "/tokenize",
        lambda: {"model": MODEL, "prompt": "a\ud800b"},
        "invalid_unicode",
        "prompt",
        id="lone surrogate",
    ),
    pytest.param(
        "/tokenize",
        lambda: {
            "model": MODEL,
            "prompt": "x",
            "chat_template_kwargs": {str(i): 1 for i in range(300)},
        },
        "too_many_items",
        "chat_template_kwargs",
        id="300 template kwargs",
    ),
    pytest.param(
        "/detokenize",
        lambda: {"model": MODEL, "tokens": [1, 2], "extra": nested(700)},
        "nested_too_deeply",
        "extra",
        id="detokenize deep",
    ),
]


@pytest.mark.parametrize(("path", "make", "code", "param"), CASES)
async def test_hostile_tokenize_bodies_get_the_limits_400(fleet, gateway, path, make, code, param):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, gw.url + path, make())
        assert status == 400, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == code and err["param"].startswith(param), err
        # A well-formed body still goes through.
        status, _, body = await post(s, gw.url + "/tokenize", {"model": MODEL, "prompt": "hi"})
        assert status == 200 and body["tokens"], body
