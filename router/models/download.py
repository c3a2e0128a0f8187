"""The opt-in start-up download of a model's tokenizer (``tokenizer_download: true``).

A model whose tokenizer is on no path the gateway looks at (router/models/tokenizers.py) is
otherwise routed by its text prefix. Where the operator allows it, its tokenizer files -- never
weights -- are fetched once, before the gateway serves (or, for a model that appears later, in
a background thread, never on a request's path), into the Hugging Face cache the gateway reads
(``HF_HUB_CACHE`` / ``HF_HOME``), from ``HF_ENDPOINT`` (a mirror) or the Hub, with
huggingface_hub's own client, token (``HF_TOKEN`` or a stored login, for gated models) and
timeouts (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``). ``HF_HUB_OFFLINE`` (or
``TRANSFORMERS_OFFLINE``) wins: nothing is fetched. One endpoint that does not answer is not
asked again for the other models.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

from router.models.tokenizers import hub_cache

log = logging.getLogger("prefix_router.models")

DEFAULT_ENDPOINT = "https://huggingface.co"
# What vLLM's tokenizer and chat template read (and what refuses a family by name:
# tekken.json). The first that exists is enough to call the download a success.
REQUIRED = ("tokenizer_config.json", "tokenizer.json")
OPTIONAL = (
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tekken.json",
)


def offline() -> str | None:
    """The variable that forbids downloads, when one is set."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return var
    return None


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def repo_ids(name: str, root: str | None) -> list[str]:
    """The hub ids to try: the card's root (what vLLM loaded), then the served name."""
    out = []
    for c in (root, name):
        if c and c.count("/") == 1 and not c.startswith(("/", ".", "~")) and c not in out:
            out.append(c)
    return out


def unreachable(url: str) -> str | None:
    """Why ``url``'s host does not answer, or None when it answers at all (any HTTP status).
    One quick probe first: huggingface_hub retries a refused connection for ~23 s per file."""
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # an answer (404, 401, ...): huggingface_hub says what it means
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}"


def describe() -> str:
    """The start-up line's text."""
    var = offline()
    if var is not None:
        return f"tokenizer download: allowed, but {var} is set: nothing is downloaded"
    token = "with" if os.environ.get("HF_TOKEN") else "without"
    return (
        f"tokenizer download: on: the tokenizer files of a model not found on this host are "
        f"fetched from {endpoint()} into {hub_cache()} before serving ({token} HF_TOKEN)"
    )


class Downloader:
    """Fetches one model's tokenizer files (blocking: call it off the event loop)."""

    def __init__(self) -> None:
        self._unreachable: str | None = None  # the endpoint that did not answer, and why
        self._lock = threading.Lock()

    def __call__(self, name: str, root: str | None) -> tuple[str | None, str]:
        """(the snapshot directory, what happened) for ``name``; None when nothing came."""
        var = offline()
        if var is not None:
            return None, f"not downloaded: {var} is set"
        ids = repo_ids(name, root)
        if not ids:
            return None, f"not downloaded: neither {name!r} nor its root {root!r} is a hub id"
        with self._lock:
            if self._unreachable is not None:
                return None, f"not downloaded: {self._unreachable}"
            why = ""
            for repo in ids:
                path, why, reachable = self._fetch(repo)
                if path is not None:
                    log.info("model %s: tokenizer downloaded (%s) into %s", name, why, path)
                    return path, why
                if not reachable:
                    self._unreachable = why
                    break
            return None, why

    def _fetch(self, repo: str) -> tuple[str | None, str, bool]:
        """(directory, what happened, whether the endpoint answered)."""
        from huggingface_hub import hf_hub_download

        where = endpoint()
        why_not = unreachable(f"{where}/{repo}/resolve/main/{REQUIRED[0]}")
        if why_not is not None:
            return None, f"{where} did not answer ({why_not})", False
        got: list[str] = []
        folder: str | None = None
        for filename in REQUIRED + OPTIONAL:
            if filename not in REQUIRED and not got:
                break  # no tokenizer file: not worth asking for the rest
            try:
                path = hf_hub_download(
                    repo, filename, revision="main", cache_dir=str(hub_cache()), endpoint=where
                )
            except Exception as e:  # huggingface_hub's errors differ between its versions
                kind = type(e).__name__
                if "LocalEntryNotFound" in kind:  # no answer, and not in the cache
                    cause = e.__cause__ or e
                    first = (str(cause).splitlines() or [""])[0][:200]
                    return None, f"{where} did not answer ({type(cause).__name__}: {first})", False
                if "EntryNotFound" in kind:
                    continue  # the repo has no such file
                first = (str(e).splitlines() or [""])[0][:200]
                if "RepositoryNotFound" in kind:
                    return None, f"{where} has no model {repo!r}", True
                if "GatedRepo" in kind or "401" in first or "403" in first:
                    return None, f"{repo!r} on {where} needs access (set HF_TOKEN): {first}", True
                if "HTTPError" in kind or "HfHub" in kind:
                    return None, f"{where} refused {repo}/{filename}: {first}", True
                return None, f"{where} did not answer ({kind}: {first})", False
            got.append(filename)
            folder = str(Path(path).parent)
        if folder is None:
            return None, f"{where} has no tokenizer files for {repo!r}", True
        return folder, f"{repo} from {where}: {', '.join(got)}", True
