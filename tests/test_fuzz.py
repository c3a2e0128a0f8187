"""Property-based hostile bodies through the real HTTP server (issue 18).

Bodies are drawn from the OpenAI chat/completions request shapes, then mutated as a hostile
client would: deep nesting at any field, huge arrays and strings, wrong types, lone
surrogates, special-token strings, broken JSON bytes. Every answer must be a non-5xx; a 4xx
carries an OpenAI error object; no request costs more than a generous CPU budget; the gateway
keeps serving. ``PREFIX_ROUTER_FUZZ_EXAMPLES`` (default 100) runs deeper.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("PREFIX_ROUTER_FUZZ_EXAMPLES", "100"))
MODEL = "Qwen/Qwen3-0.6B"
KEY = "sk-fuzz-tenant-0123456789abcdef"
CPU_BUDGET_S = 3.0  # per request, gateway + replica + client in this process: generous

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]
text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(SPECIAL),
    st.lists(st.sampled_from([*SPECIAL, "a", " ", "\n", "é", "\x00"]), max_size=8).map("".join),
)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), text)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)

content_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}
    ),
    st.dictionaries(text, json_value, max_size=3),
)
tool_call = st.fixed_dictionaries(
    {
        "id": text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": text, "arguments": st.one_of(st.just("{}"), json_value.map(json.dumps), text)}
        ),
    }
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
        "content": st.one_of(text, st.lists(content_part, max_size=3), st.none()),
    },
    optional={
        "name": text,
        "tool_calls": st.lists(tool_call, max_size=2),
        "tool_call_id": text,
        "reasoning_content": text,
    },
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": text},
            optional={"description": text, "parameters": st.dictionaries(text, json_value)},
        ),
    }
)
common = {
    "max_tokens": st.integers(0, 8),
    "stream": st.booleans(),
    "temperature": st.floats(0, 2),
    "cache_salt": text,
    "n": st.integers(1, 2),
    "user": text,
    "metadata": json_value,
}
chat_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=4)},
    optional={
        **common,
        "tools": st.lists(tool, max_size=3),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_value),
        "chat_template_kwargs": st.dictionaries(text, json_value, max_size=4),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "add_special_tokens": st.booleans(),
        "reasoning_effort": st.sampled_from(["low", "medium", "high", "none", "bogus"]),
    },
)
completion_body = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            text,
            st.lists(st.integers(-5, 200_000), min_size=1, max_size=20),
            st.lists(text, min_size=1, max_size=3),
        ),
    },
    optional=common,
)


def deep(depth: int, as_dict: bool) -> str:
    """A placeholder for ``depth`` nested lists/objects, expanded by ``encode`` (the value
    itself would overflow json.dumps' and this test's own recursion)."""
    return f"\x01deep:{depth}:{int(as_dict)}"


def _expand(match: re.Match[bytes]) -> bytes:
    depth, as_dict = int(match[1]), match[2] == b"1"
    if as_dict:
        return b'{"k":' * depth + b'"x"' + b"}" * depth
    return b"[" * depth + b'"x"' + b"]" * depth


_DEEP = re.compile(rb'"\\u0001deep:(\d+):([01])"')


nested = st.builds(deep, st.sampled_from([65, 500, 700, 900, 5000]), st.booleans())
hostile_value = st.one_of(
    nested,  # nesting past the limit: the commonest 500 once, so drawn most often
    nested,
    nested,
    st.integers(1_000, 30_000).map(lambda n: [0] * n),  # a big array
    st.integers(1_000, 30_000).map(lambda n: [{}] * n),
    st.integers(10_000, 300_000).map(lambda n: "x" * n),  # a long string
    st.sampled_from(["\ud800", "a\udfffb", {"\udc00": 1}, ["\ud83d"]]),  # lone surrogates
    st.sampled_from(SPECIAL),
    json_scalar,  # a wrong type, mostly
    json_value,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Positions in ``value`` (the root excluded) a mutation can replace: 6 levels down, the
    first 4 items of each container (earlier mutations may have made huge or deep ones)."""
    if not isinstance(value, (dict, list)) or len(prefix) >= 6:
        return []
    out: list[tuple[Any, ...]] = []
    keys = list(value)[:4] if isinstance(value, dict) else range(min(4, len(value)))
    for k in keys:
        out.append((*prefix, k))
        out.extend(paths(value[k], (*prefix, k)))
    return out


def replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replace(value[path[0]], path[1:], new)
    return copy


# Fields the gateway itself reads, normalises or renders: a hostile value set at one of
# these (intermediate objects created as needed) reaches the deepest processing.
PROCESSED = [
    ("messages",),
    ("messages", 0),
    ("messages", 0, "content"),
    ("messages", 0, "content", 0, "text"),
    ("messages", 0, "name"),
    ("messages", 0, "tool_calls"),
    ("messages", 0, "tool_calls", 0, "function", "arguments"),
    ("messages", 0, "tool_calls", 0, "extra"),
    ("messages", 0, "tools"),
    ("messages", 0, "tools", 0, "function", "parameters"),
    ("tools",),
    ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "name"),
    ("tool_choice",),
    ("chat_template_kwargs",),
    ("chat_template_kwargs", "enable_thinking"),
    ("chat_template_kwargs", "tools"),
    ("chat_template_kwargs", "documents"),
    ("documents",),
    ("cache_salt",),
    ("model",),
    ("prompt",),
    ("prompt", 0),
    ("max_tokens",),
    ("stream",),
    ("kv_transfer_params", "prompt_token_ids"),
    ("truncate_prompt_tokens",),
]


# Containers the gateway walks into (normalising, the salt policy, rendering).
DEEP_AT = [
    ("chat_template_kwargs", "enable_thinking"),
    ("chat_template_kwargs", "enable_thinking", "x"),
    ("tools", 0, "function", "parameters", "properties"),
    ("messages", 0, "tool_calls", 0, "extra"),
    ("messages", 0, "tools", 0, "function", "parameters"),
    ("messages", 0, "content", 0, "text"),
    ("metadata",),
]


def put(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``value`` with ``new`` at ``path``, creating the objects and lists on the way."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        copy = list(value) if isinstance(value, list) and value else [{}]
        copy[0] = put(copy[0], rest, new)
        return copy
    copy = dict(value) if isinstance(value, dict) else {}
    copy[head] = put(copy.get(head), rest, new)
    return copy


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    # A random body is mostly refused early; a hostile value inside an otherwise valid one
    # reaches normalising and rendering (where the 500s were).
    body = draw(
        st.one_of(
            base,
            st.just(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            ),
        )
    )
    for _ in range(draw(st.integers(0, 2))):
        where = paths(body)
        op = draw(st.sampled_from(["deep", "deep", "processed", "anywhere", "new"]))
        if op in ("deep", "processed"):  # "deep": nesting inside a field the gateway reads
            value = draw(nested if op == "deep" else hostile_value)
            body = put(body, draw(st.sampled_from(DEEP_AT if op == "deep" else PROCESSED)), value)
        elif where and op == "anywhere":
            body = replace(body, draw(st.sampled_from(where)), draw(hostile_value))
        else:  # a new field, or a known one with a hostile value
            key = draw(st.one_of(text, st.sampled_from(sorted({*common, "tools", "messages"}))))
            body = {**body, key: draw(hostile_value)}
    return body


def encode(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800
    return _DEEP.sub(_expand, raw)


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    endpoint = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    base = chat_body if endpoint.endswith("chat/completions") else completion_body
    raw = encode(draw(mutated(base)))
    kind = draw(st.sampled_from(["json", "json", "json", "json", "truncated", "bad-utf8"]))
    if kind == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "bad-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[at:]
    return endpoint, raw


def send(url: str, path: str, raw: bytes | None, method: str = "POST") -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        conn.request(
            method,
            path,
            body=raw,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def keys_file(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump({"salt_secrets": "s-0123456789abcdef", "tenants": {"t": {"keys": [KEY]}}})
    )
    return path


async def test_hostile_bodies_never_get_a_5xx(tmp_path, fleet, gateway):
    replicas = await fleet(1, instant=True, max_model_len=4096)
    gw = await gateway(
        [replicas[0].url], auth=True, api_keys_file=str(keys_file(tmp_path / "k.yaml"))
    )
    seen: dict[int, int] = {}
    worst_cpu = 0.0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(raw_bodies())
    def check(case: tuple[str, bytes]) -> None:
        nonlocal worst_cpu
        path, raw = case
        t0 = time.process_time()
        status, answer = send(gw.url, path, raw)
        cpu = time.process_time() - t0
        worst_cpu = max(worst_cpu, cpu)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (status, answer[:300], raw[:300])
        assert cpu < CPU_BUDGET_S, (cpu, raw[:300])
        if status >= 400:
            error = json.loads(answer)["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert isinstance(error["message"], str) and error["message"]
            assert error["param"] is None or isinstance(error["param"], str)
            assert "Traceback" not in error["message"] and "internal" not in error["message"]
        assert send(gw.url, "/health", None, "GET")[0] == 200  # still serving

    await asyncio.to_thread(check)
    assert sum(seen.values()) >= EXAMPLES and any(s < 400 for s in seen), seen
    print(
        f"fuzz: {sum(seen.values())} requests, statuses {sorted(seen.items())}, "
        f"worst CPU {worst_cpu * 1000:.0f} ms"
    )
