"""router.prompt against vLLM 0.34.0 for tokenizer families beyond Qwen3 (Llama 3, DeepSeek-V3):
every case in tests/data/families/FAMILY.jsonl (made by vLLM itself with
tools/make_family_fixtures.py), with and without the segment cache."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from router.prompt import Renderer
from tests.families import FAMILY_NAMES, family_dir
from tests.prompt.common import check_oracle_case

DATA = Path(__file__).resolve().parents[1] / "data" / "families"


def cases(family: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{family}.jsonl").read_text().splitlines()]


@lru_cache(maxsize=8)
def renderer(family: str, segment_cache: bool) -> Renderer:
    from transformers import AutoTokenizer

    meta = json.loads((DATA / f"{family}.meta.json").read_text())
    return Renderer(
        AutoTokenizer.from_pretrained(str(family_dir(family))),
        segment_cache=segment_cache,
        max_model_len=meta["max_model_len"],
        vocab_size=meta["vocab_size"],
    )


ALL = [(f, c) for f in FAMILY_NAMES for c in cases(f)]


def test_each_family_has_substantial_fixtures() -> None:
    for family in FAMILY_NAMES:
        cs = cases(family)
        assert len(cs) >= 60
        assert sum("error" in c["expected"] for c in cs) >= 10
        assert sum("prompt" in c["body"] for c in cs) >= 8
        # The families tokenize differently from each other (and from Qwen3).
    simple = {f: next(c for c in cases(f) if c["id"] == "chat_simple") for f in FAMILY_NAMES}
    ids = {f: tuple(c["expected"]["token_ids"]) for f, c in simple.items()}
    assert len(set(ids.values())) == len(ids)


@pytest.mark.parametrize("segment_cache", [True, False], ids=["segments", "plain"])
@pytest.mark.parametrize("family,case", ALL, ids=[f"{f}-{c['id']}" for f, c in ALL])
def test_matches_vllm(family: str, case: dict[str, Any], segment_cache: bool) -> None:
    check_oracle_case(renderer(family, segment_cache), case)
