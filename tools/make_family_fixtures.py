#!/usr/bin/env python
"""Oracle fixtures for the tokenizer families beyond Qwen3 (tests/data/families/).

For each family fetched by tools/fetch_test_tokenizers.py, runs vLLM 0.34.0's own renderer
(the CPU oracle, as tools/make_oracle_fixtures.py does for Qwen3) with that family's tokenizer
directory as the model, on the same request bodies as the Qwen3 fixture less the ones that
name Qwen3 token ids, and records vLLM's prompt token ids (or its refusal). The default test
run (tests/prompt/test_families.py) checks router.prompt.Renderer against them.

    python tools/make_family_fixtures.py                 # every family; oracle as for Qwen3
    python tools/make_family_fixtures.py --check         # compare only, write nothing

Takes ~1 minute per family (the oracle starts in ~30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.fetch_test_tokenizers import FAMILIES, complete, default_dir  # noqa: E402
from tools.make_oracle_fixtures import (  # noqa: E402
    CASES,
    agrees,
    expected_of,
    oracle_available,
    oracle_dir,
    renderer_result,
    run_oracle,
)

OUT_DIR = ROOT / "tests" / "data" / "families"
# vLLM's tool parser for each family (the default, hermes, needs Qwen's <tool_call> tokens).
SERVE_ARGS = {
    "llama3": "--enable-auto-tool-choice --tool-call-parser llama3_json",
    "deepseek_v3": "--enable-auto-tool-choice --tool-call-parser deepseek_v3",
}


def family_cases() -> list[tuple[str, dict[str, Any]]]:
    """The Qwen3 bodies less those whose token ids are Qwen3's (another vocabulary)."""
    out = []
    for rid, body in CASES:
        if rid.startswith(("cmpl_token_ids", "cmpl_list_of_token_lists", "cmpl_max_vocab_id")):
            continue
        if "prompt_token_ids" in json.dumps(body.get("kv_transfer_params") or {}):
            continue
        out.append((rid, body))
    out.append(("cmpl_token_ids_small", {"prompt": [1, 2, 3, 400, 5000]}))
    return out


def model_dir(tok: Path, tmp: Path) -> Path:
    """The oracle's model dir: the family's files (config.json names the architecture)."""
    d = tmp / tok.name
    d.mkdir()
    for f in tok.iterdir():
        if f.is_file():
            (d / f.name).symlink_to(f.resolve())
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle", help="oracle dir (as tools/make_oracle_fixtures.py)")
    ap.add_argument("--check", action="store_true", help="compare the Renderer, do not write")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    a = ap.parse_args()
    path = oracle_dir(a.oracle)
    if not oracle_available(path):
        print(f"no oracle at {path}", file=sys.stderr)
        return 2
    from router.prompt import Renderer

    cases = family_cases()
    bad = 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for family in a.family or sorted(FAMILIES):
        tok = default_dir() / family
        if not complete(tok, FAMILIES[family][2]):
            print(f"{family}: not fetched (python tools/fetch_test_tokenizers.py)", file=sys.stderr)
            return 2
        config = json.loads((tok / "config.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            mdir = model_dir(tok, Path(tmp))
            args = ["--model", str(mdir), "--serve-args", SERVE_ARGS[family]]
            results = run_oracle(cases, path, extra_args=args)
        renderers = {
            mode: Renderer.from_pretrained(
                str(tok),
                segment_cache=mode,
                max_model_len=config["max_position_embeddings"],
                vocab_size=config["vocab_size"],
            )
            for mode in (True, False)
        }
        lines, differs = [], 0
        for rid, body in cases:
            exp = expected_of(results[rid])
            for mode, r in renderers.items():
                got = renderer_result(r, body)
                if not agrees(exp, got):
                    differs += 1
                    print(
                        f"DIFFERS {family} {rid} (segment_cache={mode}): vllm {str(exp)[:160]} / router {str(got)[:160]}"
                    )
            lines.append(json.dumps({"id": rid, "body": body, "expected": exp}))
        n_err = sum(1 for rid, _ in cases if "error" in results[rid])
        print(f"{family}: {len(cases)} cases ({n_err} rejected by vLLM); {differs} disagreements")
        bad += differs
        if not a.check:
            (OUT_DIR / f"{family}.jsonl").write_text("\n".join(lines) + "\n")
            meta = {
                "vllm": "0.34.0",
                "source": (tok / "SOURCE").read_text().strip(),
                "max_model_len": config["max_position_embeddings"],
                "vocab_size": config["vocab_size"],
                "serve_args": SERVE_ARGS[family],
                "cases": len(cases),
            }
            (OUT_DIR / f"{family}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
