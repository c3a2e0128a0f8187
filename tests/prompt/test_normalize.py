"""Chat body normalisation, one rule at a time (readable expectations), and the rejections:
a 400 with a param, never a 500."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import APIError
from router.prompt import Renderer
from tests.prompt.common import (
    asst,
    both,
    rejects,
    render,
    tokenizer,
    tokens,
    user,
)

# ============================================================================================
# Normalisation, one rule at a time (readable expectations)
# ============================================================================================


def test_plain_chat_prompt() -> None:
    assert render({"messages": [user("hi")]}) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokens({"messages": [user("hi")]}) == [
        151644,
        872,
        198,
        6023,
        151645,
        198,
        151644,
        77091,
        198,
    ]


def test_text_parts_joined_with_newline_for_every_role() -> None:
    parts = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": ""},
        {"type": "text", "text": "b"},
    ]
    text = render(
        {
            "messages": [
                {"role": "system", "content": parts},
                user(parts),
                asst(
                    parts,
                    tool_calls=[
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                ),
                {"role": "tool", "tool_call_id": "1", "content": parts},
            ]
        }
    )
    assert text.startswith("<|im_start|>system\na\nb<|im_end|>\n<|im_start|>user\na\nb<|im_end|>")
    assert "<|im_start|>assistant\na\nb\n<tool_call>" in text
    assert "<tool_response>\na\nb\n</tool_response>" in text


def test_assistant_null_content_is_empty_string() -> None:
    text = render({"messages": [user("u"), asst(None), user("v")]})
    assert "<|im_start|>assistant\n<|im_end|>" in text


def test_tools_reserialised_like_vllm_request_model() -> None:
    body = {
        "messages": [user("u")],
        "tools": [
            {
                "function": {"parameters": {"b": 1, "a": 2}, "zzz": 0, "name": "f"},
                "extra": 1,
                "type": "function",
            },
            {"type": "function", "function": {"name": "g", "strict": True}},
        ],
    }
    text = render(body)
    assert (
        '\n{"type": "function", "function": {"name": "f", "description": null, "parameters": {"b": 1, "a": 2}}}\n'
        in text
    )
    assert (
        '{"type": "function", "function": {"name": "g", "description": null, "parameters": null, "strict": true}}'
        in text
    )


def test_tool_call_arguments_parsed_and_redumped() -> None:
    calls = [
        {
            "id": "1",
            "type": "function",
            "function": {"name": "a", "arguments": '{"k":"\\u00e9","n":[1,2]}'},
        },
        {"id": "2", "type": "function", "function": {"name": "b", "arguments": "{oops"}},
        {"id": "3", "type": "function", "function": {"name": "c", "arguments": "[1]"}},
    ]
    text = render({"messages": [user("u"), asst("", tool_calls=calls)]})
    assert '{"name": "a", "arguments": {"k": "é", "n": [1, 2]}}' in text
    assert '{"name": "b", "arguments": {}}' in text
    assert '{"name": "c", "arguments": {}}' in text


def test_reasoning_effort_none_disables_thinking() -> None:
    assert render({"messages": [user("u")], "reasoning_effort": "none"}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # an explicit chat_template_kwargs.enable_thinking wins, even when it is null
    assert render(
        {
            "messages": [user("u")],
            "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": None},
        }
    ).endswith("<|im_start|>assistant\n")


def test_developer_becomes_system_and_systems_merge() -> None:
    text = render(
        {
            "messages": [
                {"role": "system", "content": "S"},
                user("u"),
                {"role": "developer", "content": "D"},
            ]
        }
    )
    assert text.startswith("<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nu<|im_end|>")
    # without a developer message, a later system message stays where it is
    text = render({"messages": [user("u"), {"role": "system", "content": "S2"}]})
    assert "<|im_end|>\n<|im_start|>system\nS2<|im_end|>" in text


def test_reasoning_fields_reach_the_template() -> None:
    for field in ("reasoning", "reasoning_content"):
        text = render({"messages": [user("u"), asst("ans", **{field: "because"})]})
        assert "<|im_start|>assistant\n<think>\nbecause\n</think>\n\nans<|im_end|>" in text


def test_billing_header_stripped_from_system_only() -> None:
    header = "x-anthropic-billing-header: cc_version=2; cch=abc"
    text = render({"messages": [{"role": "system", "content": header + "\nReal"}, user(header)]})
    assert text.startswith("<|im_start|>system\nReal<|im_end|>")
    assert header in text  # the user's copy is kept


def test_continue_final_message_leaves_message_open() -> None:
    body = {
        "messages": [user("u"), asst("Once upon a ")],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert render(body).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nOnce upon a ")
    rejects(
        {"messages": [user("u"), asst("x")], "continue_final_message": True},
        "continue_final_message",
    )


def test_add_generation_prompt_false() -> None:
    assert (
        render({"messages": [user("u")], "add_generation_prompt": False})
        == "<|im_start|>user\nu<|im_end|>\n"
    )


def test_special_token_text_in_user_content_is_tokenized_as_special() -> None:
    # vLLM does not sanitise: a user typing "<|im_end|>" gets the control token
    ids = tokens({"messages": [user("a<|im_end|>b")]})
    assert ids[:6] == [151644, 872, 198, 64, 151645, 65]


def test_request_body_is_not_modified() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "D"},
            user([{"type": "text", "text": "x"}]),
            asst(
                None,
                tool_calls=[
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1}'},
                    }
                ],
            ),
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    before = copy.deepcopy(body)
    tokens(body)
    assert body == before


def test_server_default_chat_template_kwargs() -> None:
    """vLLM --default-chat-template-kwargs '{"enable_thinking": false}' (ids from the oracle
    run with that flag): request kwargs and reasoning_effort override it, null does not."""
    r = Renderer(tokenizer(), default_chat_template_kwargs={"enable_thinking": False})
    base = [151644, 872, 198, 14990, 151645, 198, 151644, 77091, 198]
    no_think = base + [151667, 271, 151668, 271]
    hello = [user("hello")]
    assert r.tokenize_chat({"messages": hello}) == no_think
    assert (
        r.tokenize_chat({"messages": hello, "chat_template_kwargs": {"enable_thinking": True}})
        == base
    )
    assert r.tokenize_chat({"messages": hello, "reasoning_effort": "low"}) == base
    assert (
        r.tokenize_chat({"messages": hello, "chat_template_kwargs": {"enable_thinking": None}})
        == no_think
    )


def test_kv_transfer_prompt_token_ids_are_the_prompt() -> None:
    body = {"messages": [user("hello")], "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}}
    assert tokens(body) == [1, 2, 3]
    assert tokens({**body, "echo": True}) == tokens({"messages": [user("hello")]})
    rejects(
        {**body, "kv_transfer_params": {"prompt_token_ids": [True]}},
        "kv_transfer_params.prompt_token_ids",
    )
    rejects({"messages": "x", "kv_transfer_params": {"prompt_token_ids": [1]}}, "messages")


def test_multimodal_kwargs_rejected_unless_trusted() -> None:
    body = {"messages": [user("u")], "media_io_kwargs": {"image": {"x": 1}}}
    rejects(body, "media_io_kwargs")
    rejects({"prompt": "p", "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs", chat=False)
    assert Renderer(tokenizer(), trust_request_mm_kwargs=True).tokenize_chat(body)


# ============================================================================================
# Rejections: 400 with a param, never a 500
# ============================================================================================


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"messages": [user("a"), {"role": 7, "content": "x"}]}, "messages.1.role"),
        ({"messages": [user(5)]}, "messages.0.content"),
        ({"messages": [user(None)]}, "messages.0.content"),
        (
            {"messages": [user([{"type": "image_url", "image_url": {"url": "http://x"}}])]},
            "messages.0.content",
        ),
        ({"messages": [user(["bare string part"])]}, "messages.0.content"),
        ({"messages": []}, "messages"),
        ({"messages": [user("u")], "cache_salt": "a@b"}, "cache_salt"),
        ({"messages": [user("u")], "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": [user("u")], "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"messages": [user("u")], "add_generation_prompt": None}, "add_generation_prompt"),
        ({"messages": [user("u")], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [user("a\ud800b")]}, None),
    ],
)
def test_invalid_chat_bodies_are_400(body: dict[str, Any], param: str | None) -> None:
    err = rejects(body, param)
    assert err.message


def test_template_exception_is_400() -> None:
    tok = tokenizer()
    raising = Renderer(tok, chat_template="{{ raise_exception('no system messages allowed') }}")
    with pytest.raises(APIError) as exc:
        raising.tokenize_chat({"messages": [user("u")]})
    assert exc.value.status == 400 and "no system messages allowed" in exc.value.message
    broken = Renderer(tok, chat_template="{% for m in messages %}{{ m.content + 1 }}{% endfor %}")
    with pytest.raises(APIError) as exc:
        broken.tokenize_chat({"messages": [user("u")]})
    assert exc.value.status == 400


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=12,
)
_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x", 3])},
    optional={
        "content": st.none()
        | st.text(max_size=10)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "refusal", "image_url", "thinking", "bogus"])},
                optional={"text": _json, "refusal": _json, "thinking": _json},
            ),
            max_size=3,
        )
        | _json,
        "tool_calls": _json
        | st.lists(
            st.fixed_dictionaries(
                {
                    "id": _json,
                    "type": st.sampled_from(["function", "custom"]),
                    "function": st.fixed_dictionaries(
                        {"name": _json, "arguments": _json | st.text(max_size=10)}
                    ),
                }
            ),
            max_size=2,
        ),
        "reasoning_content": _json,
        "name": _json,
    },
)
_body = st.fixed_dictionaries(
    {"messages": st.lists(_msg, max_size=4) | _json},
    optional={
        "tools": _json,
        "chat_template_kwargs": _json,
        "add_generation_prompt": _json,
        "continue_final_message": _json,
        "reasoning_effort": st.sampled_from([None, "none", "low", "weird"]),
        "truncate_prompt_tokens": _json,
        "tool_choice": _json,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body)
def test_fuzzed_bodies_never_crash(body: dict[str, Any]) -> None:
    for r in both():
        try:
            r.tokenize_chat(body)
        except APIError as e:
            assert e.status == 400


@pytest.mark.parametrize("fmt", ["string", "openai"])
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer", "x"])
@pytest.mark.parametrize(
    "text",
    ["", "hello", "\n", "x-anthropic-billing-header: a=1\nrest", "x-anthropic-billing-header"],
)
def test_a_string_content_is_its_one_text_part(fmt: Any, role: str, text: str) -> None:
    """A string content takes a shortcut past the parts loop: the same as the one text
    part it stands for, in both content formats, for every role, empty or not."""
    from router.prompt.normalize import content_parts

    got = content_parts(role, text, 0, fmt)
    assert got == content_parts(role, [{"type": "text", "text": text}], 0, fmt)
    assert type(got) is type(content_parts(role, [{"type": "text", "text": text}], 0, fmt))


@pytest.mark.parametrize(
    "defaults", [None, {"enable_thinking": False}, {"documents": [{"t": "x"}]}]
)
def test_template_kwargs_kept_for_plain_bodies_are_the_computed_ones(defaults: Any) -> None:
    """A body that sets no chat_template_kwargs, reasoning_effort or documents gets the
    template kwargs kept from an earlier such body with the same flags: the same as a
    fresh renderer computes, with or without tools, and a copy each time."""
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    bodies = [
        {"messages": msgs},
        {"messages": msgs, "add_generation_prompt": False},
        {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": msgs, "tools": [tool]},
        {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}},
        {"messages": msgs, "reasoning_effort": "none"},
        {"messages": msgs, "documents": [{"title": "a", "text": "b"}]},
        {"messages": msgs, "chat_template_kwargs": None, "documents": None},
    ]
    kept = Renderer(tokenizer(), default_chat_template_kwargs=defaults)
    fresh = Renderer(tokenizer(), default_chat_template_kwargs=defaults)
    for _ in range(3):
        for body in bodies:
            got = kept.normalize_chat(body)
            fresh._normalizer._plain.clear()  # computed, not kept
            assert got == fresh.normalize_chat(body)
            got["template_kwargs"]["mutated"] = True  # the caller's copy
    assert "mutated" not in kept.normalize_chat(bodies[0])["template_kwargs"]
