"""vLLM's TokenizeParams: truncation side, the character budget, max_model_len."""

from __future__ import annotations

import pytest

from router.core.errors import APIError
from router.prompt import Renderer
from tests.prompt.common import (
    tokenizer,
    tokens,
    user,
)


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
