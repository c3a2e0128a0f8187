"""Files shipped inside the package (``[tool.setuptools.package-data]``), located relative to
it so they are found the same way from a source checkout, an editable install and a wheel."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def tokenizer_dir(name: str = "qwen3") -> Path:
    """A bundled tokenizer's directory; ``qwen3`` (Qwen3's tokenizer and chat template) is the
    one the simulator, the load tests and the test suite use by default."""
    return ASSETS_DIR / "tokenizers" / name
