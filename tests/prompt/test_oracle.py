"""router.prompt against vLLM 0.34.0: every oracle case (tests/data/oracle_cases.jsonl, made by
vLLM itself with tools/make_oracle_fixtures.py), with and without the segment cache."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from router.errors import APIError
from tests.prompt.common import (
    CASES,
    PLAIN,
    SEG,
    renderer,
)


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
