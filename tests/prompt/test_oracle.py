"""router.prompt against vLLM 0.34.0: every oracle case (tests/data/oracle_cases.jsonl, made by
vLLM itself with tools/make_oracle_fixtures.py), with and without the segment cache."""

from __future__ import annotations

from typing import Any

import pytest

from tests.prompt.common import CASES, PLAIN, SEG, check_oracle_case, renderer


def test_fixture_is_substantial() -> None:
    assert len(CASES) >= 30
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids))
    assert sum("error" in c["expected"] for c in CASES) >= 10
    assert sum("prompt" in c["body"] for c in CASES) >= 8


@pytest.mark.parametrize("mode", [SEG, PLAIN])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_matches_vllm(case: dict[str, Any], mode: str) -> None:
    check_oracle_case(renderer(mode == SEG), case)
