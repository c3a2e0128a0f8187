"""The segment-cache tokenizer: hits, the token bound, thread safety, the unsafe-tokenizer
fallback, and (property tests) segment-cached ids == whole-prompt ids."""

from __future__ import annotations

import asyncio
import copy
import threading
from functools import lru_cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import APIError
from router.prompt import NeedsThread, Renderer
from tests.prompt.common import (
    renderer,
    tokenizer,
    user,
)


def test_qwen3_added_tokens_allow_segment_split() -> None:
    backend = tokenizer().backend_tokenizer
    for tok in backend.get_added_tokens_decoder().values():
        assert not (tok.lstrip or tok.rstrip or tok.single_word or tok.normalized), tok
    assert renderer(True).segment_cache is True
    assert renderer(False).segment_cache is False


def test_repeated_system_prompt_hits_the_cache() -> None:
    r = Renderer(tokenizer())
    system = {"role": "system", "content": "You are helpful. " * 400}
    r.tokenize_chat({"messages": [system, user("first")]})
    info = r.cache_info()
    ids = r.tokenize_chat({"messages": [system, user("second")]})
    after = r.cache_info()
    assert after["hits"] > info["hits"]
    assert ids == renderer(False).tokenize_chat({"messages": [system, user("second")]})


def test_cache_is_bounded_by_tokens() -> None:
    r = Renderer(tokenizer(), segment_cache_tokens=400)
    plain = renderer(False)
    for i in range(60):
        body = {
            "messages": [{"role": "system", "content": f"system {i} " * 10}, user(f"q{i} " * 5)]
        }
        assert r.tokenize_chat(body) == plain.tokenize_chat(body)
        assert r.cache_info()["tokens"] <= 400
    # a segment larger than a quarter of the budget is not cached at all
    r.clear_cache()
    r.tokenize_chat({"messages": [user("word " * 200)]})
    assert all(len(v) <= 100 for v in r._cache.values())


def test_unsafe_tokenizer_falls_back_to_whole_prompt() -> None:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer().backend_tokenizer)
    backend.add_special_tokens([AddedToken("<|sticky|>", lstrip=True, rstrip=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.chat_template = tokenizer().chat_template
    r = Renderer(tok, segment_cache=True)
    assert r.segment_cache is False
    text = "a   <|sticky|>   b<|im_end|>"
    assert r.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def test_threads_share_the_cache_safely() -> None:
    r = Renderer(tokenizer(), segment_cache_tokens=3000)
    plain = renderer(False)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": f"shared {i % 3} " * 50},
                user(f"u{i} " * (i % 7 + 1)),
            ]
        }
        for i in range(80)
    ]
    expected = [plain.tokenize_chat(b) for b in bodies]
    errors: list[str] = []

    def work(offset: int) -> None:
        for k in range(len(bodies)):
            i = (k + offset) % len(bodies)
            if r.tokenize_chat(bodies[i]) != expected[i]:
                errors.append(f"body {i}")

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 27, 53)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert r.cache_info()["tokens"] <= 3000


async def test_tokenize_chat_async() -> None:
    r = renderer(True)
    small = {"messages": [user("hi")]}
    large = {"messages": [user("long " * 5000)]}
    assert await r.tokenize_chat_async(small) == r.tokenize_chat(small)
    assert await r.tokenize_chat_async(large) == r.tokenize_chat(large)
    with pytest.raises(APIError):
        await asyncio.ensure_future(r.tokenize_chat_async({"messages": "bad"}))


# ---- property test: segment-cached ids == whole-prompt ids ---------------------------------

_ADDED = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|fim_prefix|>",
    "<|vision_pad|>",
]
_TRICKY = [
    "<|im_",
    "im_end|>",
    "<|",
    "|>",
    "<",
    ">",
    "<<|im_end|>>",
    "<|im_end|<|im_end|>",
    " ",
    "  ",
    "   \n",
    "\n",
    "\n\n\n",
    "\r\n",
    "\t",
    " \u00a0",
    "\u3000",
    "\u2028",
    "e\u0301",
    "\u0301",
    "\u0308\u0301",
    "\u1100",
    "\u1161",
    "\u11a8",
    "\u212b",
    "\ufb01",
    "مرحبا",
    "שלום",
    "\u200f",
    "\u202e",
    "東京",
    "👩‍👩‍👧",
    "🏳️‍🌈",
    "\u200d",
    "\ufe0f",
    "'s",
    "'ll",
    "123456",
    "don't",
    "supercalifragilistic" * 20,
    "x" * 257,
    ".",
    "...",
    "!!!",
]
_piece = st.sampled_from(_ADDED + _TRICKY) | st.text(max_size=6)
_adversarial = st.lists(_piece, max_size=14).map("".join)


@settings(max_examples=250, deadline=None)
@given(_adversarial, st.booleans())
def test_segment_encode_equals_whole_encode(text: str, add_special: bool) -> None:
    expected = tokenizer().encode(text, add_special_tokens=add_special)
    assert renderer(True).encode(text, add_special_tokens=add_special) == expected
    assert renderer(False).encode(text, add_special_tokens=add_special) == expected


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _adversarial),
        min_size=1,
        max_size=5,
    ),
    st.booleans(),
    st.sampled_from([None, "none"]),
)
def test_segment_chat_equals_whole_chat(
    turns: list[tuple[str, str]], agp: bool, effort: str | None
) -> None:
    body: dict[str, Any] = {"messages": [{"role": role, "content": text} for role, text in turns]}
    body["add_generation_prompt"] = agp
    if effort:
        body["reasoning_effort"] = effort
    small_cache = _small_cache_renderer()
    try:
        expected = renderer(False).tokenize_chat(body)
    except APIError:
        return  # e.g. empty render
    assert renderer(True).tokenize_chat(body) == expected
    assert small_cache.tokenize_chat(body) == expected


@lru_cache(maxsize=1)
def _small_cache_renderer() -> Renderer:
    return Renderer(tokenizer(), segment_cache_tokens=64)


def test_cache_scopes_do_not_share_entries() -> None:
    # A hit under another tenant's salt would let it time whether a text was sent recently:
    # a scope sees only its own entries, and the ids are the same in every scope.
    r = Renderer(tokenizer())
    body = {"messages": [{"role": "system", "content": "Scoped system prompt. " * 50}]}
    with r.cache_scope("tenant-a"):
        ids = r.tokenize_chat(body)
    hits = r.cache_info()["hits"]
    with r.cache_scope("tenant-b"):
        assert r.tokenize_chat(body) == ids
    assert r.cache_info()["hits"] == hits  # another salt: every segment a miss
    assert r.tokenize_chat(body) == ids
    assert r.cache_info()["hits"] == hits  # the unsalted scope is a scope of its own
    with r.cache_scope("tenant-a"):
        assert r.tokenize_chat(body) == ids
    assert r.cache_info()["hits"] > hits  # the same salt again: hits


def test_inline_budget_hands_uncached_text_to_a_thread() -> None:
    r = Renderer(tokenizer())
    body = {"messages": [user("Text nobody has sent before. " * 40)]}
    with r.inline(100), pytest.raises(NeedsThread):
        r.tokenize_chat(body)
    ids = r.tokenize_chat(body)  # no budget outside the block: encoded and cached
    with r.inline(100):
        assert r.tokenize_chat(body) == ids  # cached now: tokenized in place


@settings(max_examples=250, deadline=None)
@given(st.lists(_piece | st.sampled_from(["<", "<|", "<<|im_end|>", "<|im_st"]), max_size=14))
def test_pieces_found_by_the_lead_character_equal_the_regex_search(parts: list[str]) -> None:
    """``pieces`` finds added tokens with ``str.find`` of their common first character; the
    cuts are the regex search's (``finditer``) exactly."""
    text = "".join(parts)
    seg = renderer(True)._segments
    assert seg._split_lead == "<" and seg._split_re is not None
    want: list[str | int] = []
    pos = 0
    for m in seg._split_re.finditer(text):
        if m.start() > pos:
            want.append(text[pos : m.start()])
        want.append(seg._added[m.group()])
        pos = m.end()
    if pos < len(text):
        want.append(text[pos:])
    assert seg.pieces(text) == want
