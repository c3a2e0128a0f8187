"""router.prompt: vLLM-exact chat rendering / tokenization and the segment-cache fast path.

The oracle fixtures (tests/data/oracle_cases.jsonl) were produced by vLLM 0.34.0 itself
(tools/make_oracle_fixtures.py); every case is checked with and without the segment cache.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.bundled import tokenizer_dir
from router.errors import APIError
from router.prompt import Renderer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = tokenizer_dir()
FIXTURE = ROOT / "tests" / "data" / "oracle_cases.jsonl"
ORACLE_MAX_MODEL_LEN = 40960  # the oracle's model config
ORACLE_VOCAB_SIZE = 151936


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@lru_cache(maxsize=4)
def renderer(segment_cache: bool) -> Renderer:
    return Renderer(
        tokenizer(),
        segment_cache=segment_cache,
        max_model_len=ORACLE_MAX_MODEL_LEN,
        vocab_size=ORACLE_VOCAB_SIZE,
    )


SEG = "seg"
PLAIN = "plain"


def both() -> list[Renderer]:
    return [renderer(True), renderer(False)]


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def asst(text: Any, **kw: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **kw}


def render(body: dict[str, Any]) -> str:
    out = {r.render_chat(body) for r in both()}
    assert len(out) == 1
    return out.pop()


def tokens(body: dict[str, Any]) -> list[int]:
    seg, plain = (r.tokenize_chat(body) for r in both())
    assert seg == plain
    return seg


def rejects(body: dict[str, Any], param: str | None = None, *, chat: bool = True) -> APIError:
    for r in both():
        with pytest.raises(APIError) as exc:
            if chat:
                r.tokenize_chat(body)
            else:
                r.tokenize_completion_request(body)
        assert exc.value.status == 400
        if param is not None:
            assert exc.value.param == param, exc.value.message
    return exc.value


# ============================================================================================
# Conformance with vLLM 0.34.0 (fixtures from the oracle)
# ============================================================================================

CASES = [json.loads(line) for line in FIXTURE.read_text().split("\n") if line.strip()]


def test_fixture_is_substantial() -> None:
    assert len(CASES) >= 30
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids))
    assert sum("error" in c["expected"] for c in CASES) >= 10
    assert sum("prompt" in c["body"] for c in CASES) >= 8


@pytest.mark.parametrize("mode", [SEG, PLAIN])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_matches_vllm(case: dict[str, Any], mode: str) -> None:
    r = renderer(mode == SEG)
    body = copy.deepcopy(case["body"])
    before = copy.deepcopy(body)
    expected = case["expected"]
    if "error" in expected:
        with pytest.raises(APIError) as exc:
            if "messages" in body:
                r.tokenize_chat(body)
            else:
                r.tokenize_completion_request(body)
        assert exc.value.status == 400
    elif "messages" in body:
        assert r.tokenize_chat(body) == expected["token_ids"]
    else:
        got = r.tokenize_completion_request(body)
        assert got == (expected["results"] if "results" in expected else [expected["token_ids"]])
    assert body == before, "the renderer must not modify the request body"


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


def test_truncation_defaults_to_left() -> None:
    full = tokens({"messages": [user("one two three four five six seven")]})
    assert (
        tokens(
            {"messages": [user("one two three four five six seven")], "truncate_prompt_tokens": 4}
        )
        == full[-4:]
    )
    right = {
        "messages": [user("one two three four five six seven")],
        "truncate_prompt_tokens": 4,
        "truncation_side": "right",
    }
    assert tokens(right) == full[:4]


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


# ============================================================================================
# Budgets and limits
# ============================================================================================


def test_token_budget_guard() -> None:
    small = Renderer(tokenizer(), max_prompt_chars=1000)
    assert small.tokenize_chat({"messages": [user("x" * 100)]})
    with pytest.raises(APIError) as exc:
        small.tokenize_chat({"messages": [user("x" * 5000)]})
    assert exc.value.status == 400 and exc.value.code == "prompt_too_long"
    with pytest.raises(APIError):
        small.tokenize_chat({"messages": [user("x" * 600), user("y" * 600)]})
    with pytest.raises(APIError):
        small.tokenize_completion("z" * 1001)
    with pytest.raises(APIError):
        small.tokenize_completion_batch(["z" * 600, "z" * 600])


def test_max_model_len() -> None:
    r = Renderer(tokenizer(), max_model_len=16)
    assert len(r.tokenize_chat({"messages": [user("hi")]})) == 9
    rejects_ = [
        {"messages": [user("one two three four five six seven eight nine ten")]},
        {"messages": [user("hi")], "truncate_prompt_tokens": 17},
        {"messages": [user("hi")], "max_tokens": 17},
    ]
    for body in rejects_:
        with pytest.raises(APIError):
            r.tokenize_chat(body)
    # -1 = the longest prompt that leaves room for one output token
    ids = r.tokenize_chat(
        {
            "messages": [user("one two three four five six seven eight nine ten")],
            "truncate_prompt_tokens": -1,
        }
    )
    assert len(ids) == 15


# ============================================================================================
# Completions
# ============================================================================================


def test_completions_prompt_forms() -> None:
    for r in both():
        assert r.tokenize_completion("hi there") == tokenizer().encode("hi there")
        assert r.tokenize_completion([1, 2, 3]) == [1, 2, 3]
        assert r.tokenize_completion(["only"]) == tokenizer().encode("only")
        assert r.tokenize_completion([[5, 6]]) == [5, 6]
        # several prompts: tokenize_completion is the first one, the batch has them all
        assert r.tokenize_completion(["a b", "c"]) == tokenizer().encode("a b")
        assert r.tokenize_completion_batch(["a b", "c"]) == [
            tokenizer().encode("a b"),
            tokenizer().encode("c"),
        ]
        assert r.tokenize_completion_batch([[1], [2, 3]]) == [[1], [2, 3]]
        assert r.tokenize_completion([True, 2.0]) == [1, 2]  # pydantic's lax ints, as vLLM
        assert r.tokenize_completion("<|im_start|>") == [151644]


@pytest.mark.parametrize(
    "prompt",
    ["", [], [[]], [1, -1], [1, 2.5], [151936], ["a", [1]], [[1], "a"], {"a": 1}, None, [None]],
)
def test_completions_invalid_prompts(prompt: Any) -> None:
    for r in both():
        with pytest.raises(APIError) as exc:
            r.tokenize_completion(prompt)
        assert exc.value.status == 400 and exc.value.param == "prompt"


def test_completions_request_options() -> None:
    r = renderer(True)
    assert r.tokenize_completion_request({"prompt": "a b c d e", "truncate_prompt_tokens": 2}) == [
        tokenizer().encode("a b c d e")[-2:]
    ]
    rejects({"prompt": "x", "cache_salt": ""}, "cache_salt", chat=False)
    rejects({"prompt": "x", "suffix": "y"}, "suffix", chat=False)


def test_vocab_size_defaults_to_tokenizer_length() -> None:
    r = Renderer(tokenizer())
    assert r.vocab_size == len(tokenizer())
    with pytest.raises(APIError):
        r.tokenize_completion([len(tokenizer())])


# ============================================================================================
# Segment cache
# ============================================================================================


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
