"""Completions prompts: the forms vLLM accepts, token-id validation, request options."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.errors import APIError
from router.prompt import Renderer
from tests.prompt.common import (
    both,
    rejects,
    renderer,
    tokenizer,
)


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
