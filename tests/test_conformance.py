"""Live conformance: router.prompt.Renderer against vLLM 0.34.0's own renderer (opt-in).

Runs the CPU vLLM oracle (shared/tools/vllm_oracle) on the fixture bodies plus randomly
generated ones and compares token ids with both segment-cache modes. Skipped unless
PREFIX_ROUTER_ORACLE points at a built oracle directory:

    PREFIX_ROUTER_ORACLE=~/.cache/prefix-eval/vllm-oracle pytest -m conformance tests/test_conformance.py

PREFIX_ROUTER_CONFORMANCE_SEED fixes the random bodies (default: a new seed every run, shown
in the test ids); PREFIX_ROUTER_CONFORMANCE_N sets how many (default 60). One oracle process
serves the whole module (~20 s to start, ~10 ms a body).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from router.core.bundled import tokenizer_dir

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "oracle_cases.jsonl"

pytestmark = pytest.mark.conformance


def _load_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_oracle_fixtures", ROOT / "tools" / "make_oracle_fixtures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()
ORACLE = os.environ.get("PREFIX_ROUTER_ORACLE")
if not ORACLE or not tool.oracle_available(Path(ORACLE).expanduser()):
    pytest.skip(
        "set PREFIX_ROUTER_ORACLE to a built vLLM oracle dir (shared/tools/vllm_oracle/setup.sh)",
        allow_module_level=True,
    )

SEED = int(
    os.environ.get("PREFIX_ROUTER_CONFORMANCE_SEED") or random.SystemRandom().randrange(10**6)
)
N_RANDOM = int(os.environ.get("PREFIX_ROUTER_CONFORMANCE_N") or 60)

BODIES: list[tuple[str, dict[str, Any]]] = [
    (c["id"], c["body"])
    for c in (json.loads(line) for line in FIXTURE.read_text().split("\n") if line.strip())
]
BODIES += tool.random_bodies(N_RANDOM, SEED)


@lru_cache(maxsize=1)
def oracle_results() -> dict[str, dict[str, Any]]:
    return tool.run_oracle(BODIES, Path(ORACLE).expanduser())  # type: ignore[arg-type]


@lru_cache(maxsize=2)
def renderer(segment_cache: bool) -> Any:
    from router.prompt import Renderer

    return Renderer.from_pretrained(
        str(tokenizer_dir()),
        segment_cache=segment_cache,
        max_model_len=tool.ORACLE_MAX_MODEL_LEN,
        vocab_size=tool.ORACLE_VOCAB_SIZE,
    )


@pytest.mark.parametrize("segment_cache", [True, False], ids=["seg", "plain"])
@pytest.mark.parametrize(("rid", "body"), BODIES, ids=[rid for rid, _ in BODIES])
def test_renderer_matches_live_vllm(rid: str, body: dict[str, Any], segment_cache: bool) -> None:
    out = oracle_results()[rid]
    if str(out.get("error", "")).startswith("oracle crashed"):
        pytest.skip(f"the oracle itself crashed on this body: {out['error']}")
    expected = tool.expected_of(out)
    got = tool.renderer_result(renderer(segment_cache), body)
    assert tool.agrees(expected, got), (
        f"seed={SEED} body={json.dumps(body)[:2000]}\nvllm={str(expected)[:1000]}\nrouter={str(got)[:1000]}"
    )


def test_fixture_file_is_current() -> None:
    """The checked-in expectations still equal what the oracle says now."""
    results = oracle_results()
    stale = []
    for line in FIXTURE.read_text().split("\n"):
        if not line.strip():
            continue
        case = json.loads(line)
        now = tool.expected_of(results[case["id"]])
        if ("error" in now) != ("error" in case["expected"]) or (
            "error" not in now and now != case["expected"]
        ):
            stale.append(case["id"])
    assert not stale, f"regenerate with tools/make_oracle_fixtures.py: {stale}"
