"""``explain`` and ``diagnose`` find their tokenizer as ``serve`` does: the model id the
gateway maps to its bundled tokenizer (no hub, no cache), and with no --tokenizer the model
the bodies name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.ops import explain
from router.ops.diagnose import command as diagnose
from tests.helpers import chat_body

MODEL = "Qwen/Qwen3-0.6B"  # bundled as router/assets/tokenizers/qwen3


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network and an empty Hugging Face cache: only a bundled tokenizer can load."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def bodies_file(tmp_path: Path, n: int = 4, model: str = MODEL) -> Path:
    path = tmp_path / "bodies.jsonl"
    rows = [chat_body(f"question {i}", model=model) for i in range(n)]
    path.write_text("".join(json.dumps(b) + "\n" for b in rows))
    return path


@pytest.mark.parametrize("flags", [["--tokenizer", MODEL], []], ids=["model-id", "from-body"])
def test_explain_finds_the_bundled_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offline_env: None, flags: list[str]
) -> None:
    path = bodies_file(tmp_path)
    assert explain.main([str(path), *flags]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 4 and all(r["token_ids"] for r in rows)
    assert f"tokenizer the bundled one for {MODEL}" in err


@pytest.mark.parametrize("flags", [["--tokenizer", MODEL], []], ids=["model-id", "from-body"])
def test_diagnose_finds_the_bundled_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offline_env: None, flags: list[str]
) -> None:
    path = bodies_file(tmp_path)
    assert diagnose.main([str(path), "--json", *flags]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["scope"]["skipped_lines"] == 0
    assert f"tokenizer the bundled one for {MODEL}" in err


def test_no_tokenizer_and_no_model_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bodies.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert diagnose.main([str(path)]) == 2
    assert "no request body names its model; pass --tokenizer" in capsys.readouterr().err
