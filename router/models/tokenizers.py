"""Where a model's tokenizer comes from, in order, and loading it (local files only).

1. the config (``models: NAME: tokenizer:``), or ``--tokenizer`` when the fleet serves one model;
2. the model's ``root`` (what ``/v1/models`` says it was loaded from) when that is a directory
   on this host;
3. the Hugging Face cache on this host, for the model's root and then its name, found the way
   vLLM finds it (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub);
4. a tokenizer bundled with the gateway for that model.

Nothing is downloaded here: the request path must never wait on a model hub (the opt-in
start-up download is router/models/download.py). Families vLLM
does not render with the Hugging Face chat template (Mistral's ``mistral`` tokenizer mode,
GPT-OSS's harmony format) are refused by name: their requests are routed by the text-prefix
fallback instead of being hashed with token ids the replica would not produce.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.core.bundled import tokenizer_dir, tokenizer_for_model
from router.prompt import Renderer

log = logging.getLogger("prefix_router")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HOW_TO_GIVE = (
    "give it under models: in the config (models: {NAME: {tokenizer: /path/to/dir}}), "
    "or put the model in this host's Hugging Face cache, or allow a start-up download "
    "(tokenizer_download: true)"
)


@dataclass(frozen=True)
class Found:
    """A tokenizer directory and how it was found (for logs and explain)."""

    path: str
    origin: str  # "config", "flag", "root", "hf_cache", "bundled"


class Unsupported(Exception):
    """A tokenizer vLLM does not render with the Hugging Face template (named in the text)."""


def hub_cache() -> Path:
    """The Hugging Face hub cache as huggingface_hub (and so vLLM) resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _has_tokenizer(d: Path) -> bool:
    return d.is_dir() and any((d / f).is_file() for f in TOKENIZER_FILES)


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` in the hub cache that holds a tokenizer: the one
    ``refs/main`` names, else the most recently written one."""
    if not repo_id or repo_id.startswith(("/", ".", "~")) or repo_id.count("/") > 1:
        return None
    repo = (cache or hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    with contextlib.suppress(OSError):
        ref = (repo / "refs" / "main").read_text().strip()
        if ref and _has_tokenizer(snapshots / ref):
            return snapshots / ref
    candidates = [d for d in snapshots.iterdir() if _has_tokenizer(d)]
    return max(candidates, key=lambda d: d.stat().st_mtime) if candidates else None


def import_transformers() -> None:
    """Import transformers' tokenizer classes once, on the calling thread. A first import
    racing in two worker threads failed with "cannot import name 'AutoTokenizer'" (its lazy
    module is not thread-safe): the gateway calls this before any worker thread starts."""
    from transformers import AutoTokenizer  # noqa: F401


def resolve_name(name: str) -> Path | None:
    """A configured tokenizer: a local directory, or a model id in the hub cache."""
    p = Path(name).expanduser()
    if _has_tokenizer(p):
        return p
    # A model id with a bundled tokenizer resolves as router/models/loading.py resolves --tokenizer
    # without replicas: the same flag must not mean two things by the fleet's state.
    return cached_snapshot(name) or tokenizer_for_model(name)


def find(
    name: str, root: str | None, configured: str | None, flag: str | None = None
) -> Found | None:
    """Where ``name``'s tokenizer is, or None. ``configured`` (models:) and ``flag``
    (--tokenizer, given only when it applies to this model) win; a configured tokenizer
    that cannot be found is an error, not a silent fallback."""
    for given, origin in ((configured, "config"), (flag, "flag")):
        if given:
            path = resolve_name(given)
            if path is None:
                raise FileNotFoundError(
                    f"tokenizer {given!r} for model {name!r} ({origin}) is neither a directory "
                    "with tokenizer.json / tokenizer_config.json nor a model in the local "
                    f"Hugging Face cache ({hub_cache()})"
                )
            return Found(str(path), origin)
    for candidate in dict.fromkeys(c for c in (root, name) if c):
        p = Path(candidate).expanduser()
        if p.is_absolute() and _has_tokenizer(p):
            return Found(str(p), "root")
        snap = cached_snapshot(candidate)
        if snap is not None:
            return Found(str(snap), "hf_cache")
    for candidate in dict.fromkeys(c for c in (name, root) if c):
        bundled = tokenizer_for_model(candidate)
        if bundled is not None:
            return Found(str(bundled), "bundled")
    return None


def _json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


def check_family(path: str) -> None:
    """Raise ``Unsupported`` for tokenizers vLLM renders by other means than the HF template."""
    d = Path(path)
    if (d / "tekken.json").is_file() or any(d.glob("tokenizer.model.v*")):
        raise Unsupported(
            "a Mistral tokenizer (tekken.json / tokenizer.model.vN): vLLM renders it with "
            "mistral-common (--tokenizer-mode mistral), which the gateway does not reproduce"
        )
    model_type = _json(d / "config.json").get("model_type")
    harmony = '"<|channel|>"' in _read_head(d / "tokenizer.json")
    if model_type == "gpt_oss" or harmony:
        raise Unsupported(
            "GPT-OSS's harmony format: vLLM renders its chat requests with openai-harmony, "
            "not the chat template, which the gateway does not reproduce"
        )


def _read_head(path: Path, limit: int = 4 << 20) -> str:
    with contextlib.suppress(OSError), path.open(encoding="utf-8", errors="replace") as f:
        return f.read(limit)
    return ""


def model_vocab_size(path: str) -> int:
    """Token ids a completions prompt may carry: the model's ``vocab_size`` from a
    ``config.json`` beside the tokenizer (larger than the tokenizer's own vocabulary), else
    anything a uint32 holds: the replica judges."""
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return int(_json(Path(path) / "config.json")["vocab_size"])
    return 2**32 - 1


# The classes that encode with tokenizer.json as it is: what a config.json cannot change.
_AS_FILED = ("TokenizersBackend", "PreTrainedTokenizerFast")


def class_note(path: str, tokenizer: Any) -> str | None:
    """One line when ``path`` is a tokenizer folder without ``config.json`` and transformers
    chose a class of its own (e.g. LlamaTokenizer) from tokenizer_config.json: with the
    model's config.json, which vLLM always loads, the model type can choose another
    (transformers forces TokenizersBackend for phi3 and others), and the ids differ."""
    d = Path(path).expanduser()
    if not d.is_dir() or (d / "config.json").is_file():
        return None
    if d.resolve() == tokenizer_dir().resolve():  # the bundled Qwen3 files: checked with vLLM
        return None
    name = type(tokenizer).__name__
    if name in _AS_FILED:
        return None
    return (
        f"tokenizer folder {path} has no config.json, so transformers chose {name} without "
        "the model's type and cannot know the class vLLM loads (it reads the model "
        "directory's config.json); copy the model's config.json beside the tokenizer files"
    )


def load(
    found: Found,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
    max_prompt_chars: int = 4_000_000,
) -> Renderer:
    """A Renderer for ``found`` (blocking: seconds; run it off the event loop). Raises
    ``Unsupported``, or whatever transformers raises for unreadable files."""
    check_family(found.path)
    from transformers import AutoTokenizer

    template = None
    if chat_template:
        template = Path(chat_template).expanduser().read_text()
    tok = AutoTokenizer.from_pretrained(found.path, local_files_only=True)
    note = class_note(found.path, tok) if found.origin != "bundled" else None
    if note is not None:
        log.warning("%s", note)
    del max_model_len  # the replicas enforce the context; the gateway checks it per model
    return Renderer(
        tok,
        vocab_size=model_vocab_size(found.path),
        chat_template=template,
        default_chat_template_kwargs=chat_template_kwargs or None,
        max_prompt_chars=max_prompt_chars,
    )
