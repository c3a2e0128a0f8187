"""Issue 18: bodies that gave a 500, or cost seconds of CPU before a 400, are refused up front
with a 400 naming the field; limits are configurable. Real gateway, simulated replica."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from router.config import ConfigError, load_config
from router.core.errors import APIError
from router.intake.shapes import DEFAULT_LIMITS, BodyLimits, check_body
from tests.helpers import post

MODEL = "Qwen/Qwen3-0.6B"
KEY = "sk-limits-tenant-0123456789abcdef"


def nested_list(depth: int, leaf: Any = "x") -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def nested_dict(depth: int) -> dict[str, Any]:
    v: dict[str, Any] = {}
    for _ in range(depth):
        v = {"a": v}
    return v


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (name, body, the param the 400 names, its code): every body the issue lists.
ISSUE_CASES = [
    (
        "deep tools[].function.parameters",
        body(tools=[tool({"type": "object", "properties": nested_dict(700)})]),
        "tools[0].function.parameters.properties.a",
        "nested_too_deeply",
    ),
    (
        "deep list as chat_template_kwargs.enable_thinking",
        body(chat_template_kwargs={"enable_thinking": nested_list(800)}),
        "chat_template_kwargs.enable_thinking[0]",
        "nested_too_deeply",
    ),
    (
        "deep extra field in tool_calls[]",
        body(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                            "extra": nested_list(900),
                        }
                    ],
                },
            ]
        ),
        "messages[1].tool_calls[0].extra[0]",
        "nested_too_deeply",
    ),
    (
        "deep developer-message tools",
        body(
            messages=[
                {"role": "developer", "content": "d", "tools": [tool(nested_dict(600))]},
                {"role": "user", "content": "hi"},
            ]
        ),
        "messages[0].tools[0].function.parameters.a",
        "nested_too_deeply",
    ),
    ("lone surrogate in cache_salt", body(cache_salt="\ud800"), "cache_salt", "invalid_unicode"),
    (
        "lone surrogate in content",
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]),
        "messages[0].content[0].text",
        "invalid_unicode",
    ),
    (
        "lone surrogate in a key",
        body(chat_template_kwargs={"\ud800": 1}),
        'chat_template_kwargs["\\ud800"]',
        "invalid_unicode",
    ),
    (
        "100,000 empty messages",
        body(messages=[{"role": "user", "content": ""}] * 100_000),
        "messages",
        "too_many_items",
    ),
    (
        "100,000 chat_template_kwargs keys",
        body(chat_template_kwargs={f"k{i}": i for i in range(100_000)}),
        "chat_template_kwargs",
        "too_many_items",
    ),
]


def segments(param: str) -> int:
    return param.count(".") + param.count("[") + 1


def keys_file(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump({"salt_secrets": "s-0123456789abcdef", "tenants": {"t": {"keys": [KEY]}}})
    )
    return path


@pytest.mark.parametrize("name,payload,param,code", ISSUE_CASES, ids=[c[0] for c in ISSUE_CASES])
async def test_issue_bodies_get_a_400_naming_the_field(
    tmp_path, fleet, gateway, name, payload, param, code
):
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], auth=True, api_keys_file=str(keys_file(tmp_path / "k.yaml"))
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    raw = json.dumps(payload).encode()  # ensure_ascii: a lone surrogate is sent as \ud800
    async with aiohttp.ClientSession() as s:
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", raw, auth)
        assert status == 400, answer
        got = answer["error"]["param"]
        if code == "nested_too_deeply":  # the first container past the limit: 64 levels down
            assert got.startswith(param) and segments(got) == 64, got
        else:
            assert got == param
        assert answer["error"]["code"] == code
        assert answer["error"]["type"] == "BadRequestError"
        ok = await post(s, gw.url + "/v1/chat/completions", body(), auth)
        assert ok[0] == 200


async def test_many_messages_refused_before_anything_is_rendered(fleet, gateway, monkeypatch):
    """The 100,000-empty-messages body cost ~5.7 s of gateway CPU before its 400, spent
    rendering it; now the count is checked before anything is rendered. A body just under
    the limit is rendered (so the count below watches the renderer the gateway uses)."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_messages=20_000)
    renderer = gw.gateway.renderer
    renders: list[int] = []
    real_render = renderer._render

    def counted(norm: dict[str, Any]) -> str:
        renders.append(len(norm["conversation"]))
        return real_render(norm)

    monkeypatch.setattr(renderer, "_render", counted)
    many = json.dumps(body(messages=[{"role": "user", "content": ""}] * 100_000))
    under = json.dumps(body(messages=[{"role": "user", "content": ""}] * 20_000, max_tokens=1))
    async with aiohttp.ClientSession() as s:
        refused = await post(s, gw.url + "/v1/chat/completions", many)
        assert refused[0] == 400 and refused[2]["error"]["code"] == "too_many_items"
        assert renders == []  # refused before rendering
        rendered = await post(s, gw.url + "/v1/chat/completions", under)
    assert rendered[0] != 400 or rendered[2]["error"]["code"] != "too_many_items"
    assert renders and renders[0] == 20_000


async def test_limits_are_configurable(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_messages=2, max_json_depth=8, max_tools=1)
    async with aiohttp.ClientSession() as s:
        three = body(messages=[{"role": "user", "content": "a"}] * 3)
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", three)
        assert status == 400 and answer["error"]["param"] == "messages"
        deep = body(metadata=nested_list(10))
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", deep)
        assert status == 400 and answer["error"]["code"] == "nested_too_deeply"
        two_tools = body(tools=[tool({}), tool({})])
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", two_tools)
        assert status == 400 and answer["error"]["param"] == "tools"
        assert (await post(s, gw.url + "/v1/chat/completions", body()))[0] == 200


def test_limits_config_is_validated():
    with pytest.raises(ConfigError, match="max_json_depth"):
        load_config(None, env={}, max_json_depth=0)
    config = load_config(None, env={"PREFIX_ROUTER_MAX_TOOLS": "7"})
    assert BodyLimits.from_config(config.limits).max_tools == 7


def refusal(payload: dict[str, Any], limits: BodyLimits = DEFAULT_LIMITS) -> APIError:
    with pytest.raises(APIError) as e:
        check_body(payload, limits)
    return e.value


def test_real_client_bodies_pass():
    schema = {"type": "object", "properties": {"q": {"type": "array", "items": nested_dict(15)}}}
    check_body(body(tools=[tool(schema)] * 128, chat_template_kwargs={"enable_thinking": False}))
    check_body(body(messages=[{"role": "user", "content": "é" * 1000}] * 3000))
    check_body({"model": MODEL, "prompt": list(range(100_000))})


def test_each_limit_names_its_field():
    small = BodyLimits(
        max_nodes=1000, max_string_chars=20, max_content_parts=2, max_prompt_chars=50
    )
    assert refusal({"prompt": list(range(2000))}, small).code == "body_too_complex"
    e = refusal(body(user="x" * 21), small)
    assert (e.param, e.code) == ("user", "string_too_long")
    parts = [{"type": "text", "text": "a"}] * 3
    e = refusal(
        body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": parts}]), small
    )
    assert (e.param, e.code) == ("messages[1].content", "too_many_items")
    e = refusal(body(messages=[{"role": "user", "content": "abcdefghi"}] * 6), small)
    assert (e.param, e.code) == ("messages", "prompt_too_long")
    e = refusal(body(**{"a.b": nested_list(70)}))
    assert e.param == '["a.b"]' + "[0]" * 63


async def test_what_cannot_fit_is_refused_before_rendering(fleet, gateway):
    """A token holds at most 128 characters of Qwen3's vocabulary: 200,000 characters are at
    least 1,563 tokens, more than a 1,000-token context. The gateway says so itself (the
    replica's own refusal says "you requested N tokens", not "at least")."""
    replicas = await fleet(1, max_model_len=1000)
    gw = await gateway([replicas[0].url], max_prompt_chars=500_000)
    async with aiohttp.ClientSession() as s:
        url = gw.url + "/v1/chat/completions"
        status, _, answer = await post(
            s, url, body(messages=[{"role": "user", "content": "ab " * 66_667}])
        )
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "(1563 or more in the messages, 4 in" in answer["error"]["message"]
        # Text that could fit (1,000 x 128 chars) is left to the tokenizer and the replica.
        status, _, answer = await post(
            s, url, body(messages=[{"role": "user", "content": "ab " * 40_000}])
        )
        assert status == 400 and "at least" not in answer["error"]["message"], answer
        assert (await post(s, url, body(max_tokens=990)))[0] == 200
        status, _, answer = await post(s, url, body(max_tokens=1001))
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


async def test_message_text_beyond_the_prompt_cap_is_refused_unrendered(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_prompt_chars=1000)
    async with aiohttp.ClientSession() as s:
        long = body(messages=[{"role": "user", "content": "x" * 600}] * 2)
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", long)
        assert status == 400 and answer["error"]["code"] == "prompt_too_long"
        assert "messages alone hold 1200 characters" in answer["error"]["message"]


def test_template_failures_are_told_in_the_clients_terms(renderer, caplog):
    """A template that trips over a value (Python's TypeError, naming internals) is a 400
    that says what was wrong; Python's own text goes to the debug log only."""
    from router.prompt import Renderer

    r = Renderer(renderer.tokenizer, chat_template="{{ messages[0]['content'] + 1 }}")
    with caplog.at_level("DEBUG", logger="router.prompt"), pytest.raises(APIError) as e:
        r.render_chat(body())
    assert e.value.status == 400 and "type or shape the template cannot render" in e.value.message
    assert "concatenate" not in e.value.message and "str" not in e.value.message
    assert any("concatenate" in rec.getMessage() for rec in caplog.records)
    # A template's own raise_exception text is the template author's message: kept.
    r = Renderer(renderer.tokenizer, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(APIError, match="no system role"):
        r.render_chat(body())
