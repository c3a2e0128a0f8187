"""Files shipped inside the package (``[tool.setuptools.package-data]``), located relative to
it so they are found the same way from a source checkout, an editable install and a wheel."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


def tokenizer_dir(name: str = "qwen3") -> Path:
    """A bundled tokenizer's directory; ``qwen3`` (Qwen3's tokenizer and chat template) is the
    one the simulator, the load tests and the test suite use by default."""
    return ASSETS_DIR / "tokenizers" / name


# Models whose tokenizer and chat template are a bundled one's (Qwen3-0.6B's files are the
# ones in assets/tokenizers/qwen3), so a gateway in front of them, or of the simulator that
# reports this model, needs no --tokenizer and no Hugging Face cache.
BUNDLED_MODELS = {"Qwen/Qwen3-0.6B": "qwen3"}


def tokenizer_for_model(model: str | None) -> Path | None:
    """The bundled tokenizer directory for ``model``, or None if none is bundled for it."""
    name = BUNDLED_MODELS.get(model or "")
    return tokenizer_dir(name) if name else None


def model_for_tokenizer(path: str | None) -> str | None:
    """The model a bundled tokenizer directory is for (None: not a bundled one)."""
    if not path:
        return None
    try:
        resolved = Path(path).expanduser().resolve()
    except OSError:
        return None
    for model, name in BUNDLED_MODELS.items():
        if tokenizer_dir(name).resolve() == resolved:
            return model
    return None
