"""The prefix-state cache (router/prompt/prefix_state.py): a prompt that extends one seen
before gets the same token ids and block hashes as the full path, on varied multi-turn
conversations, for every tokenizer family the tests have; templates that rewrite an earlier
turn are detected and take the full path."""

from __future__ import annotations

import copy
import os
from functools import cache, lru_cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import Config
from router.core import blocks
from router.gateway import Gateway
from router.models.registry import ModelEntry
from router.prompt import Renderer
from router.prompt.prefix_state import PromptIds
from router.routing.request_path import RequestPath
from tests.prompt.common import tokenizer

# A template that renders every turn the same whatever follows (keeps reasoning), in the
# "openai" content format (it loops over content parts).
_PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that writes a running count of the messages before each turn into the system
# turn: every earlier turn changes when one is added (must be detected, never reused).
_REWRITES = (
    "<|im_start|>system\nturns: {{ messages | length }}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_contained_token() -> Any:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer().backend_tokenizer)
    backend.add_special_tokens([AddedToken("<|im_end|>!", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.chat_template = tokenizer().chat_template
    return tok


def _reference_bpe() -> Any:
    """Qwen3 with Hugging Face's BPE for new text (fastokens off)."""
    os.environ["PREFIX_ROUTER_FAST_TOKENIZER"] = "0"
    try:
        return Renderer(tokenizer())
    finally:
        del os.environ["PREFIX_ROUTER_FAST_TOKENIZER"]


FAMILIES = ["qwen3", "qwen3-reference-bpe", "chatml-openai-format", "rewrites", "contained"]


@cache
def family(name: str) -> tuple[Renderer, Renderer]:
    """(the live renderer, the whole-text reference) of one tokenizer family."""
    if name == "qwen3":
        return Renderer(tokenizer()), Renderer(tokenizer(), segment_cache=False)
    if name == "qwen3-reference-bpe":
        return _reference_bpe(), Renderer(tokenizer(), segment_cache=False)
    if name in ("chatml-openai-format", "rewrites"):
        t = _PLAIN_CHATML if name == "chatml-openai-format" else _REWRITES
        return (
            Renderer(tokenizer(), chat_template=t),
            Renderer(tokenizer(), chat_template=t, segment_cache=False),
        )
    tok = _with_contained_token()
    return Renderer(tok), Renderer(tok, segment_cache=False)


@lru_cache(maxsize=1)
def request_path() -> RequestPath:
    return Gateway(Config(), family("qwen3")[0]).path


_WORDS = st.sampled_from(
    [
        "hello",
        " world",
        "the",
        "  ",
        "\n",
        "\n\n",
        "<|im_end|>",
        "<|im_start|>",
        "<think>",
        "</think>",
        "<tool_response>",
        "</tool_response>",
        "é\u0301",
        "東京",
        "'s",
        "123",
        "!",
        "x" * 40,
    ]
)
_TEXT = st.lists(_WORDS, min_size=0, max_size=12).map(" ".join)
_SYSTEMS = ["You are helpful. " * 30, "Be brief.", "Answer in French. " * 12]


@st.composite
def _message(draw: st.DrawFn, role: str) -> dict[str, Any]:
    text = draw(_TEXT)
    if role == "assistant":
        m: dict[str, Any] = {"role": role, "content": text}
        kind = draw(st.sampled_from(["plain", "think-in-content", "reasoning", "tools"]))
        if kind == "think-in-content":
            m["content"] = f"<think>\n{draw(_TEXT)}\n</think>\n\n{text}"
        elif kind == "reasoning":
            m["reasoning_content"] = draw(_TEXT)
        elif kind == "tools":
            m["tool_calls"] = [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                }
            ]
        return m
    if role == "tool":
        return {"role": "tool", "tool_call_id": "call_1", "content": text}
    if draw(st.booleans()):
        return {"role": role, "content": [{"type": "text", "text": text}]}
    return {"role": role, "content": text or "?"}


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    conv: list[dict[str, Any]] = []
    if draw(st.booleans()):
        conv.append({"role": "system", "content": draw(st.sampled_from(_SYSTEMS))})
    for _ in range(draw(st.integers(1, 4))):
        conv.append(draw(_message("user")))
        conv.append(draw(_message("assistant")))
        if "tool_calls" in conv[-1]:
            conv.append(draw(_message("tool")))
            conv.append(draw(_message("assistant")))
    return conv


def _requests(conv: list[dict[str, Any]], other_user: dict[str, Any]) -> list[list[Any]]:
    """Every request a client sends along the conversation (each ends on a user or tool
    turn), and after each a sibling with another last user turn."""
    out = []
    for n in range(1, len(conv) + 1):
        if conv[n - 1]["role"] in ("user", "tool"):
            out.append(conv[:n])
            if conv[n - 1]["role"] == "user":
                out.append([*conv[: n - 1], other_user])
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(FAMILIES),
    conversations(),
    _message("user"),
    st.sampled_from([None, "tenant-a"]),
    st.sampled_from([{}, {"enable_thinking": False}, {"tools": [{"type": "function"}]}]),
)
def test_prefix_state_ids_equal_the_full_path(
    name: str,
    conv: list[dict[str, Any]],
    other_user: dict[str, Any],
    salt: str | None,
    extra: dict[str, Any],
) -> None:
    live, reference = family(name)
    for messages in _requests(conv, other_user):
        body: dict[str, Any] = {"messages": messages}
        if "enable_thinking" in extra:
            body["chat_template_kwargs"] = dict(extra)
        if "tools" in extra:
            body["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        if salt is not None:
            body["cache_salt"] = salt
        expected = reference.tokenize_chat(copy.deepcopy(body))
        with live.cache_scope(salt):
            got = live.chat_ids(copy.deepcopy(body))
        assert list(got) == expected
        # Hashes through the gateway's hashing (known hashes of the state + the rest).
        if name == "qwen3":
            with live.cache_scope(salt):
                ids = live.chat_ids(copy.deepcopy(body))
            entry = ModelEntry("qwen3", block_size=16)
            assert request_path()._hashes(ids, None, salt, entry) == blocks.block_hashes(
                expected, 16, cache_salt=salt, namespace=entry.namespace
            )


def _chat(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"messages": list(messages)}


SYSTEM = {"role": "system", "content": "You are helpful. " * 200}


def test_a_new_user_turn_after_a_known_system_prompt_reuses_its_state() -> None:
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    live.chat_ids(_chat(SYSTEM, {"role": "user", "content": "first question"}))
    body = _chat(SYSTEM, {"role": "user", "content": "second question"})
    ids = live.chat_ids(body)
    assert isinstance(ids, PromptIds) and ids.prefix is not None
    assert len(ids.prefix.ids) > 600  # the system prompt's tokens were not tokenized again
    assert list(ids) == reference.tokenize_chat(body)
    assert live.prefix_info()["hits"] == 1


def test_the_next_turn_extends_the_previous_request() -> None:
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    first = [SYSTEM, {"role": "user", "content": "q1"}]
    live.chat_ids(_chat(*first))
    body = _chat(*first, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"})
    ids = live.chat_ids(body)
    assert isinstance(ids, PromptIds) and ids.prefix is not None
    assert list(ids) == reference.tokenize_chat(body)


def test_a_state_shares_its_prompts_ids_until_first_used() -> None:
    """The whole prompt's state keeps a reference to the prompt's ids, not a copy; the next
    turn slices its ids out of them (and gets the full path's ids)."""
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    first = [SYSTEM, {"role": "user", "content": "q1"}]
    ids = live.chat_ids(_chat(*first))
    assert isinstance(ids, PromptIds)
    (state,) = [s for s in ids.stored if s.tokens > len(ids) - 8]  # up to the last added token
    assert state.source_ids is ids and state._ids is None
    body = _chat(*first, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"})
    again = live.chat_ids(body)
    assert isinstance(again, PromptIds) and again.prefix is state
    assert state.source_ids is None and list(state.ids) == list(ids[: state.tokens])
    assert list(again) == reference.tokenize_chat(body)


def test_qwen3_dropping_earlier_reasoning_is_detected_and_takes_the_full_path() -> None:
    """Qwen3 renders an assistant turn's reasoning only after the last user query: once a
    new user turn follows, the earlier rendering changes and the state must not be used."""
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    turn = [SYSTEM, {"role": "user", "content": "q1"}]
    answer = {"role": "assistant", "content": "a1", "reasoning_content": "because"}
    tool = {"role": "tool", "tool_call_id": "c", "content": "<tool_response>r</tool_response>"}
    # The answer after the last query keeps its reasoning; the state of this prompt has it.
    live.chat_ids(_chat(*turn, answer, tool))
    body = _chat(*turn, answer, {"role": "user", "content": "q2"})
    ids = live.chat_ids(body)
    assert list(ids) == reference.tokenize_chat(body)
    assert live.prefix_info()["rejected"] >= 1
    assert "because" not in live.render_chat(body)


def test_states_are_kept_per_cache_salt_scope() -> None:
    live = Renderer(tokenizer())
    with live.cache_scope("tenant-a"):
        live.chat_ids(_chat(SYSTEM, {"role": "user", "content": "q1"}))
    with live.cache_scope("tenant-b"):
        ids = live.chat_ids(_chat(SYSTEM, {"role": "user", "content": "q2"}))
    assert isinstance(ids, PromptIds) and ids.prefix is None
    with live.cache_scope("tenant-a"):
        ids = live.chat_ids(_chat(SYSTEM, {"role": "user", "content": "q3"}))
    assert isinstance(ids, PromptIds) and ids.prefix is not None


def test_off_where_a_cut_after_an_added_token_is_not_exact() -> None:
    live, _ = family("contained")
    assert live.segment_cache is True
    assert live.prefix_state is False


@pytest.mark.parametrize("keep", [5, 700])
def test_truncation_drops_the_prefix_state(keep: int) -> None:
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    live.chat_ids(_chat(SYSTEM, {"role": "user", "content": "q1"}))
    body = {**_chat(SYSTEM, {"role": "user", "content": "q2"}), "truncate_prompt_tokens": keep}
    ids = live.chat_ids(copy.deepcopy(body))
    assert list(ids) == reference.tokenize_chat(body)
    assert getattr(ids, "prefix", None) is None  # the truncated ids are not its prefix


def test_long_texts_that_differ_only_inside_keep_their_own_states() -> None:
    """A long text is keyed by its length and ends: system prompts of one length that differ
    in the middle (a date) share a key, and each keeps its state under it (no eviction of
    the other, no full path once both were seen); a fifth variant evicts the oldest."""
    live, reference = Renderer(tokenizer()), family("qwen3")[1]
    half = "You are helpful. " * 100

    def system(day: int) -> dict[str, Any]:
        return {"role": "system", "content": f"{half}Today is 2026-12-{day:02d}. {half}"}

    for day in (1, 2):
        live.chat_ids(_chat(system(day), {"role": "user", "content": "first"}))
    for turn in range(3):
        for day in (1, 2):
            body = _chat(system(day), {"role": "user", "content": f"q{turn}"})
            ids = live.chat_ids(body)
            assert isinstance(ids, PromptIds) and ids.prefix is not None
            assert list(ids) == reference.tokenize_chat(body)
    for day in (3, 4, 5):  # the key's bucket holds four: day 1's state is the oldest
        live.chat_ids(_chat(system(day), {"role": "user", "content": "first"}))
    body = _chat(system(1), {"role": "user", "content": "again"})
    ids = live.chat_ids(body)
    assert getattr(ids, "prefix", None) is None
    assert list(ids) == reference.tokenize_chat(body)
    body = _chat(system(5), {"role": "user", "content": "again"})
    ids = live.chat_ids(body)
    assert isinstance(ids, PromptIds) and ids.prefix is not None
    assert list(ids) == reference.tokenize_chat(body)


def test_context_keys_kept_per_context_are_the_computed_ones() -> None:
    from router.prompt.prefix_state import _context_key, context_key

    def norm(**changes: Any) -> dict[str, Any]:
        base = {
            "tools": None,
            "documents": None,
            "template_kwargs": {"eos_token": "<e>", "pad_token": "<p>"},
            "add_generation_prompt": True,
            "continue_final_message": False,
            "add_special_tokens": False,
        }
        return {**base, **changes}

    variants = [
        norm(),
        norm(add_generation_prompt=False),
        norm(add_special_tokens=True),
        norm(template_kwargs={"eos_token": "<e>"}),
        norm(template_kwargs={"enable_thinking": False, "eos_token": "<e>"}),
        norm(template_kwargs={"x": [1, 2]}),  # not hashable: computed each time
        norm(tools=[{"type": "function"}]),
        norm(documents=[{"text": "d"}]),
    ]
    keys = set()
    for _ in range(2):
        for scope in (0, 7):
            for n in variants:
                assert context_key(n, scope) == _context_key(n, scope)
                keys.add(context_key(n, scope))
    assert len(keys) == 2 * len(variants)
