"""Shared helpers of the router.prompt tests: the bundled Qwen3 tokenizer, renderers with and
without the segment cache (every check runs on both), and the vLLM 0.34.0 oracle fixtures
(tests/data/oracle_cases.jsonl, produced by tools/make_oracle_fixtures.py)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from router.core.bundled import tokenizer_dir
from router.core.errors import APIError
from router.prompt import Renderer

ROOT = Path(__file__).resolve().parents[2]
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


CASES = [json.loads(line) for line in FIXTURE.read_text().split("\n") if line.strip()]


def check_oracle_case(r: Renderer, case: dict[str, Any]) -> None:
    """``r`` answers one vLLM oracle case (a fixture line: ``body``, ``expected``) as vLLM
    did: its token ids, its completion prompts' ids, or a 400; and leaves the body as it was."""
    import copy

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
