"""The chat-template sandbox's shortcuts (router/prompt/sandbox.py) give what Jinja's stock
``ImmutableSandboxedEnvironment`` gives: the same text, or the same error, for the bundled
and test tokenizers' templates and for templates that reach for dict methods, unsafe
attributes, ``str.format``, namespaces, loop attributes and builtin methods."""

from __future__ import annotations

import json
from typing import Any

import jinja2.sandbox
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import APIError
from router.prompt.sandbox import ChatSandbox
from router.prompt.template import ChatTemplate
from tests.families import FAMILY_NAMES, family_dir
from tests.prompt.common import tokenizer

# Templates that go where the shortcuts branch: dict methods and missing keys, mutating and
# underscore attributes (unsafe), str.format and format_map (sandboxed formatting), a
# namespace, loop attributes, builtin methods with keyword arguments, calls of non-builtins.
_PROBES = {
    "dict-methods": (
        "{% for m in messages %}{{ m.role }}:{{ m.get('content') }}|{{ m.keys() | list }}"
        "|{{ m.items() | list | length }}|{{ m.missing }}|{{ m['role'] }}{% endfor %}"
    ),
    "mutating": "{{ messages[0].update({'role': 'x'}) }}",
    "pop": "{% set x = messages[0].pop('role') %}{{ x }}",
    "list-append": "{{ messages.append(1) }}",
    "dunder": "{{ messages[0].__class__ }}",
    "underscore-key": "{{ messages[0]._private }}",
    "mro": "{{ messages.__class__.mro() }}",
    "format": (
        "{% for m in messages %}{{ '{}:{}'.format(m.role, m.content) }}"
        "{{ '{r}'.format_map({'r': m.role}) }}{% endfor %}"
    ),
    "format-attack": "{{ '{0.__class__}'.format(messages[0]) }}",
    "namespace": (
        "{% set ns = namespace(n=0, s='') %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s + m.role %}{% endfor %}"
        "{{ ns.n }}{{ ns.s }}{{ ns.missing }}"
    ),
    "loop": (
        "{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
        "{{ loop.length }}{{ loop.revindex }}{{ loop.previtem.role if loop.previtem }}"
        "{{ loop.cycle('a', 'b') }}{% endfor %}"
    ),
    "str-methods": (
        "{% for m in messages %}{{ m.content.strip('\\n').split('</think>')[-1].lstrip() }}"
        "{{ m.content.startswith('<tool_response>') }}{{ m.content.replace('a', 'b', 1) }}"
        "{{ m.content.encode }}{{ m.role.upper() }}{% endfor %}"
    ),
    "kwargs": "{{ messages | tojson(indent=1) }}{{ dict(a=1).get('a') }}",
    "raise": "{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}ok",
    "tools": "{% for t in tools or [] %}{{ t.function.name }}{{ t.function | tojson }}{% endfor %}",
    # Sums output term by term while every term is a string (ChatSandbox's _SumOutput).
    "sum-strings": (
        "{% for m in messages %}{{ '<' + m.role + '>' + m.content + '|' }}{{ m.role + '' }}"
        "{{ m.role + (':' + m.role) + '!' }}{% endfor %}"
    ),
    "sum-numbers": "{{ 1 + messages | length + 2 }}{{ [1] + [messages | length] }}{{ 'a' + 'b' }}",
    "sum-type-error": "{{ messages[0].role + ':' + messages | length }}",
    "sum-undefined": "{{ '<' + messages[0].nope + '>' }}",
    "sum-markup": "{{ messages[0].role + ('<b>' | safe) + messages[0].role }}",
}


def _sources() -> dict[str, str]:
    out = {"qwen3": tokenizer().chat_template, **_PROBES}
    for name in FAMILY_NAMES:
        try:
            config = json.loads((family_dir(name) / "tokenizer_config.json").read_text())
        except pytest.skip.Exception:
            continue
        out[name] = config["chat_template"]
    return out


_SOURCES = _sources()
_PAIRS = {
    name: (
        ChatTemplate(src),
        ChatTemplate(src, sandbox=jinja2.sandbox.ImmutableSandboxedEnvironment),
    )
    for name, src in _SOURCES.items()
}

_text = st.sampled_from(
    ["", "hi", "<think>why</think>\n\nso", "<tool_response>r</tool_response>", "{x}", "a\n"]
) | st.text(max_size=20)


@st.composite
def _message(draw: Any) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    m: dict[str, Any] = {"role": role, "content": draw(_text)}
    if role == "assistant" and draw(st.booleans()):
        m["reasoning_content"] = draw(_text)
    if role == "assistant" and draw(st.booleans()):
        args = draw(st.sampled_from(['{"a": 1}', "{}"]))
        m["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        ]
    return m


def _norm(messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "conversation": messages,
        "tools": tools,
        "documents": None,
        "add_generation_prompt": kwargs.pop("add_generation_prompt", True),
        "continue_final_message": False,
        "template_kwargs": kwargs,
    }


def _outcome(template: ChatTemplate, norm: dict[str, Any]) -> tuple[str, str]:
    try:
        return "text", template.render(norm, 10**9)
    except APIError as e:
        return "error", str(e)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_message(), min_size=1, max_size=6),
    st.sampled_from([None, [{"type": "function", "function": {"name": "f", "parameters": {}}}]]),
    st.fixed_dictionaries(
        {},
        optional={
            "add_generation_prompt": st.booleans(),
            "enable_thinking": st.booleans(),
            "bos_token": st.just("<s>"),
        },
    ),
)
def test_the_sandbox_renders_what_the_stock_sandbox_renders(
    messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
) -> None:
    for name, (fast, stock) in _PAIRS.items():
        got = _outcome(fast, _norm([dict(m) for m in messages], tools, dict(kwargs)))
        want = _outcome(stock, _norm([dict(m) for m in messages], tools, dict(kwargs)))
        assert got == want, name


def test_the_probes_reach_the_sandbox_errors() -> None:
    """The unsafe probes fail in both (the comparison above is not vacuous), and the fast
    environment is the one templates are compiled in."""
    norm = _norm([{"role": "user", "content": "a"}], None, {})
    for name in ("mutating", "pop", "list-append", "dunder", "mro", "format-attack"):
        fast, stock = _PAIRS[name]
        assert _outcome(fast, norm)[0] == "error" or "__class__" not in _outcome(fast, norm)[1]
        assert _outcome(fast, norm) == _outcome(stock, norm)
    assert isinstance(ChatTemplate("x")._env, ChatSandbox)
