"""Loading the tokenizer the gateway renders with: local files only, one clear line when it
cannot be loaded."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from router.core.bundled import tokenizer_for_model
from router.models.tokenizers import class_note
from router.prompt import Renderer

log = logging.getLogger("prefix_router")


def _model_vocab_size(name: str) -> int:
    """Token ids a completions prompt may carry: the model's ``vocab_size`` from a
    ``config.json`` beside the tokenizer (it is larger than the tokenizer's own vocabulary,
    e.g. 151,936 vs 151,669 for Qwen3), else anything a uint32 holds: the replica judges."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return int(json.loads((Path(name) / "config.json").read_text())["vocab_size"])
    return 2**32 - 1


def tokenizer_name(tokenizer: str | None, model: str | None) -> str | None:
    """What to load: ``tokenizer`` (a directory or a model id) or else ``model`` (the one the
    replicas report, or a request's), with a model id that has a bundled tokenizer mapped to
    it (no Hugging Face cache needed)."""
    wanted = tokenizer or model
    bundled = tokenizer_for_model(wanted)
    return str(bundled) if bundled is not None else wanted


def tokenizer_source(tokenizer: str | None, model: str | None) -> str:
    """Where the tokenizer came from, for the start-up summary."""
    name = tokenizer_name(tokenizer, model)
    if tokenizer_for_model(tokenizer or model) is not None:
        return f"the bundled one for {tokenizer or model} ({name})"
    if tokenizer:
        return f"{tokenizer} (--tokenizer)"
    return f"{name} (the model the replicas report, from the local Hugging Face cache)"


def load_renderer(
    tokenizer: str | None, reported_model: str | None, max_prompt_chars: int = 4_000_000
) -> Renderer:
    name = tokenizer_name(tokenizer, reported_model)
    if tokenizer_for_model(tokenizer or reported_model) is not None:
        log.info("tokenizer: %s", tokenizer_source(tokenizer, reported_model))
    if not name:
        raise SystemExit(
            "prefix-router: no --tokenizer given and no replica answered /v1/models with a "
            "model (is one up yet?); start the gateway once a replica is ready, or pass "
            "--tokenizer PATH_OR_MODEL_ID"
        )
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        raise SystemExit(f"prefix-router: tokenizer directory {name!r} does not exist")
    try:
        from transformers import AutoTokenizer

        # Local files only: the request path must never wait on a model hub, and offline a
        # hub lookup only retries for half a minute before failing anyway.
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        note = None if tokenizer_for_model(tokenizer or reported_model) else class_note(name, tok)
        if note is not None:
            log.warning("%s", note)
        return Renderer(
            tok,
            vocab_size=_model_vocab_size(name),
            max_prompt_chars=max_prompt_chars,
        )
    except Exception as e:  # transformers raises OSError, ValueError, HF errors...
        hint = (
            ""
            if tokenizer
            else " (the model the replicas report; pass --tokenizer to choose another)"
        )
        raise SystemExit(
            f"prefix-router: cannot load tokenizer {name!r}{hint}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            "point --tokenizer at a local directory with tokenizer.json and "
            "tokenizer_config.json, or fetch the model into the Hugging Face cache first."
        ) from None
