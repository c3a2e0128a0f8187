"""The model registry: per served model, what the gateway needs to predict its replicas'
caches, built from what the replicas report and refreshed as they come and go.

A base model (a ``/v1/models`` card without ``parent``) has one ``ModelEntry``: its renderer
(tokenizer, chat template and kwargs; None when none could be found: the text-prefix fallback,
router/models/fallback.py), block size, hash algorithm, vocabulary size, context length, the
replicas routed to and those kept apart, its index namespace (folded into every block hash, so
models never share an index key, in memory or in Redis) and its drift watch. A LoRA adapter is
a child of its base: the same entry, with the adapter's name in its block chains, routed only to
replicas that have the adapter loaded.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import router.models.blocksize as blocksize
import router.models.tokenizers as tokenizers
from router.core.bundled import model_for_tokenizer
from router.core.record import record
from router.models.drift import DriftWatch
from router.models.spec import ModelSpec, adapter_paths, alias_map, parse_models
from router.prompt import Renderer

log = logging.getLogger("prefix_router.models")

DEFAULT_BLOCK_SIZE = 16


class ReplicaView(Protocol):
    """What the registry reads of a replica (router.fleet.replicas.Replica has it)."""

    url: str
    healthy: bool
    models_known: bool
    cards: dict[str, dict[str, Any]]
    models: dict[str, str | None]

    @property
    def stats(self) -> Any: ...


@dataclass
class ModelEntry:
    name: str
    root: str | None = None
    renderer: Renderer | None = None
    tokenizer: str | None = None  # where the renderer's files are
    tokenizer_origin: str = (
        "none"  # config, flag, root, hf_cache, bundled, downloaded, injected, none
    )
    missing: str | None = None  # why there is no renderer
    block_size: int = DEFAULT_BLOCK_SIZE
    block_size_origin: str = "default"  # replicas, config, flag, default
    hash_algo: str | None = None
    max_model_len: int | None = None
    replicas: tuple[str, ...] = ()  # routed to
    apart: tuple[str, ...] = ()  # kept apart: another block size or root than the primary group
    adapters: frozenset[str] = frozenset()
    drift: DriftWatch = field(default_factory=DriftWatch)
    # pending: not looked for yet; loaded: exact; fallback: no tokenizer anywhere (declared
    # absent: the labelled text prefix); failed: one was found or given but did not load
    # (retried with backoff, router/models/upkeep.py). Readiness reads it (router/readiness.py).
    state: str = "pending"
    # The parity probe (router/models/parity.py): pending, exact, mismatch (its tokenizer is
    # set aside in ``held``: the text prefix, never hashed wrong), unavailable (no replica's
    # /tokenize answered: not checked), none (no tokenizer to check).
    parity: str = "pending"
    parity_detail: str | None = None
    parity_replicas: tuple[str, ...] = ()  # the replicas the last probe asked
    held: Renderer | None = None

    @property
    def loaded(self) -> bool:
        """Its tokenizer was looked for and the outcome is final (exact, or declared absent)."""
        return self.state in ("loaded", "fallback")

    @property
    def namespace(self) -> str:
        return self.name

    @property
    def basis(self) -> str:
        """How its requests are matched: ``tokens`` (exact) or ``text_prefix`` (fallback)."""
        return "tokens" if self.renderer is not None else "text_prefix"

    @property
    def vocab_size(self) -> int | None:
        return self.renderer.vocab_size if self.renderer is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "root": self.root,
            "basis": self.basis,
            "tokenizer": self.tokenizer,
            "tokenizer_origin": self.tokenizer_origin,
            "missing_tokenizer": self.missing,
            "tokenizer_state": self.state,
            "parity": self.parity,
            "parity_detail": self.parity_detail,
            "block_size": self.block_size,
            "block_size_origin": self.block_size_origin,
            "hash_algo": self.hash_algo,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "replicas": list(self.replicas),
            "kept_apart": list(self.apart),
            "adapters": sorted(self.adapters),
            "drift": self.drift.state(),
        }


@record
class Route:
    """What a request's ``model`` resolves to (a ``record``: one is built per request)."""

    entry: ModelEntry
    model: str  # the served name (after aliases): what is forwarded
    lora: str | None  # the adapter's name when ``model`` is a LoRA adapter
    alias_of: str | None = None  # the name the client sent, when it was an alias


Loader = Callable[..., Renderer]
# (name, root) -> (a directory with its tokenizer, what happened): the opt-in download.
Fetch = Callable[[str, "str | None"], "tuple[str | None, str]"]


class ModelRegistry:
    """Served models -> ``ModelEntry``; aliases; which replicas may take which model."""

    def __init__(
        self,
        models: Mapping[str, Any] | None = None,
        aliases: Mapping[str, Any] | None = None,
        *,
        flag_tokenizer: str | None = None,
        flag_block_size: int | None = None,
        injected: Renderer | None = None,
        max_prompt_chars: int = 4_000_000,
        loader: Loader = tokenizers.load,
    ) -> None:
        self.specs: dict[str, ModelSpec] = parse_models(models)
        self.aliases = alias_map(self.specs, aliases)
        self.loadable_adapters = adapter_paths(self.specs)  # name -> (base, path)
        self.flag_tokenizer = flag_tokenizer
        self.flag_block_size = flag_block_size
        self.injected = injected
        self.max_prompt_chars = max_prompt_chars
        self._loader = loader
        self.entries: dict[str, ModelEntry] = {}
        self._adapter_parent: dict[str, str] = {}
        self._renderers: dict[str, Renderer | None] = {}  # load key -> renderer (None: failed)
        self._load_errors: dict[str, str] = {}
        self._warned: set[str] = set()
        self.refused: str | None = None  # a contradicted configured block size (one line)
        self._offline: dict[tuple[str, bool, int], ModelEntry] = {}
        self._lock = threading.Lock()  # loads run in worker threads
        self.started = False  # the gateway is serving (refusals are logged, not fatal)
        self.fetch: Fetch | None = None  # tokenizer_download: router/models/download.py

    # -- building -----------------------------------------------------------------------------
    def refresh(self, replicas: Iterable[ReplicaView]) -> list[str]:
        """Rebuild every entry from the replicas' reports; returns the models whose
        tokenizer has not been looked for yet (``load`` them, off the event loop)."""
        replicas = list(replicas)
        bases: dict[str, dict[str, tuple[str | None, int | None]]] = {}
        cards: dict[str, dict[str, Any]] = {}
        adapters: dict[str, set[str]] = {}
        algos: dict[str, str | None] = {}
        for r in replicas:
            if not r.models_known:
                continue
            bs = getattr(r.stats, "block_size", None)
            for mid, parent in r.models.items():
                card = r.cards.get(mid) or {}
                if parent:
                    self._adapter_parent[mid] = parent
                    adapters.setdefault(parent, set()).add(mid)
                    continue
                root = card.get("root")
                bases.setdefault(mid, {})[r.url] = (str(root) if root else None, bs)
                if r.healthy or mid not in cards:
                    cards[mid] = card
                algos.setdefault(mid, getattr(r.stats, "hash_algo", None))
        for name, (base, _) in self.loadable_adapters.items():
            self._adapter_parent.setdefault(name, base)
        new: list[str] = []
        refused: list[str] = []
        for name in sorted(bases):
            entry = self.entries.get(name)
            if entry is None:
                entry = self.entries[name] = ModelEntry(name)
                new.append(name)
            spec = self.specs.get(name)
            g = blocksize.group(name, bases[name])
            if g.warning and self._once(f"groups:{name}:{g.apart}"):
                log.warning("%s", g.warning)
            sizes = {u: bases[name][u][1] for u in g.primary}
            apart = set(g.apart)
            for configured, where in (
                (spec.block_size if spec else None, f"models.{name}.block_size"),
                (self.flag_block_size, "block_size (--block-size)"),
            ):
                try:
                    blocksize.check_configured(name, configured, where, sizes)
                except blocksize.BlockSizeRefused as e:
                    refused.append(str(e))
                    # Keep serving the replicas that agree; the others are kept apart.
                    apart |= {u for u, bs in sizes.items() if bs is not None and bs != configured}
            entry.replicas = tuple(u for u in g.primary if u not in apart)
            entry.apart = tuple(sorted(apart))
            entry.root = g.root
            card = cards.get(name) or {}
            mml = card.get("max_model_len")
            entry.max_model_len = mml if type(mml) is int and mml > 0 else None
            entry.hash_algo = algos.get(name)
            entry.adapters = frozenset(adapters.get(name, ())) | frozenset(
                a for a, (b, _) in self.loadable_adapters.items() if b == name
            )
            if spec is not None and spec.block_size is not None:
                entry.block_size, entry.block_size_origin = spec.block_size, "config"
            elif self.flag_block_size is not None:
                entry.block_size, entry.block_size_origin = self.flag_block_size, "flag"
            elif g.block_size is not None:
                entry.block_size, entry.block_size_origin = g.block_size, "replicas"
        self.refused = refused[0] if refused else None
        for line in refused:
            # At start-up the gateway refuses to start with this line; later, a replica that
            # contradicts the configured size is kept apart and named once in the log.
            if self._once(f"refused:{line}") and self.started:
                log.error("%s; its replicas that disagree are kept apart", line)
        return new

    def _once(self, key: str) -> bool:
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    def _flag_applies(self, name: str) -> bool:
        """``--tokenizer`` (or a renderer handed in) names one model's tokenizer: it applies
        when the fleet serves one base model, or when it names this model; never to the
        others (hashing a model with another's tokenizer mispredicts every request)."""
        root = self.entries[name].root if name in self.entries else None
        if self.flag_tokenizer in (name, root):
            return True
        return len(self.entries) <= 1

    def load(self, name: str) -> ModelEntry:
        """Find and load ``name``'s tokenizer (blocking: call it in a thread). A model with no
        tokenizer anywhere (or one vLLM renders otherwise) gets one warning and the
        text-prefix fallback (``state`` fallback); one that was found or given but did not
        load is ``failed``, not remembered as such: the caller retries it. At start-up an
        explicit tokenizer (--tokenizer, models: NAME: tokenizer:) that cannot load stops the
        gateway with one line (SystemExit)."""
        with self._lock:
            return self._load(name)

    def unloaded(self) -> list[str]:
        return [name for name, e in self.entries.items() if not e.loaded]

    def _load(self, name: str) -> ModelEntry:
        entry = self.entries[name]
        spec = self.specs.get(name)
        if (
            self.injected is not None
            and (spec is None or not spec.tokenizer)
            and self._flag_applies(name)
        ):
            entry.renderer, entry.tokenizer, entry.tokenizer_origin = (
                self.injected,
                None,
                "injected",
            )
            entry.missing, entry.state = None, "loaded"
            return entry
        flag = self.flag_tokenizer if self._flag_applies(name) else None
        failed = False  # found or given, and not loaded: retried, never cached
        try:
            found = tokenizers.find(name, entry.root, spec.tokenizer if spec else None, flag)
        except FileNotFoundError as e:
            found, why, failed = None, str(e), True
            self._explicit_failed(name, why)
        else:
            why = f"none in the config, at its root {entry.root!r} or in {tokenizers.hub_cache()}"
            if found is None and self.fetch is not None:  # allowed, and never on a request
                path, what = self.fetch(name, entry.root)
                if path is not None:
                    found = tokenizers.Found(path, "downloaded")
                else:
                    why = f"{why}; {what}"
        if found is not None:
            key = json.dumps(
                [
                    found.path,
                    spec.chat_template if spec else None,
                    dict(spec.chat_template_kwargs) if spec else {},
                ],
                sort_keys=True,
                default=str,
            )
            if key not in self._renderers:
                try:
                    self._renderers[key] = self._loader(
                        found,
                        chat_template=spec.chat_template if spec else None,
                        chat_template_kwargs=spec.chat_template_kwargs if spec else None,
                        max_prompt_chars=self.max_prompt_chars,
                    )
                except tokenizers.Unsupported as e:
                    self._renderers[key] = None  # final: vLLM renders it otherwise
                    self._load_errors[key] = f"refused: {e}"
                except Exception as e:  # transformers raises OSError, ValueError, ImportError
                    # Not cached: a load that failed once (files still being written, a
                    # concurrent first import) is retried, never the model's state for life.
                    first = str(e).splitlines()[0] if str(e) else ""
                    why = f"cannot load {found.path}: {type(e).__name__}: {first}"
                    if found.origin in ("config", "flag"):
                        self._explicit_failed(name, why)
                    return self._failed(entry, why)
            renderer = self._renderers[key]
            if renderer is not None:
                entry.renderer, entry.tokenizer = renderer, found.path
                entry.tokenizer_origin, entry.missing = found.origin, None
                log.info(
                    "model %s: tokenizer from %s (%s), block size %d (%s), %d replica(s)",
                    name,
                    found.origin,
                    found.path,
                    entry.block_size,
                    entry.block_size_origin,
                    len(entry.replicas),
                )
                entry.state = "loaded"
                return entry
            why = self._load_errors[key]
        if failed:
            return self._failed(entry, why)
        entry.renderer, entry.tokenizer, entry.tokenizer_origin = None, None, "none"
        entry.missing, entry.state = why, "fallback"
        if self._once(f"missing:{name}"):
            log.warning(
                "model %s: no usable tokenizer (%s); its requests are routed by load and a "
                "text prefix, not hashed with another model's tokenizer; to hash it exactly, %s",
                name,
                why,
                tokenizers.HOW_TO_GIVE.replace("NAME", name),
            )
        return entry

    def _explicit_failed(self, name: str, why: str) -> None:
        """A tokenizer the operator named cannot load: at start-up that is the gateway's one
        line and exit status 2, not a gateway that runs on the text fallback."""
        if not self.started:
            raise SystemExit(f"prefix-router: model {name}: {why}")

    def _failed(self, entry: ModelEntry, why: str) -> ModelEntry:
        """A found or given tokenizer did not load: the text prefix until a retry loads it."""
        entry.renderer, entry.tokenizer, entry.tokenizer_origin = None, None, "none"
        entry.missing, entry.state = why, "failed"
        log.warning("model %s: tokenizer failed to load (%s); retrying", entry.name, why)
        return entry

    # -- the request path ---------------------------------------------------------------------
    def resolve(self, name: str | None) -> Route | None:
        """The entry for a body's ``model`` (aliases applied; an adapter resolves to its base
        with ``lora`` set); a missing model is the default one. None: not served."""
        if not name:
            default = self.default()
            return Route(default, default.name, None) if default is not None else None
        target = self.aliases.get(name, name)
        alias_of = name if target != name else None
        entry = self.entries.get(target)
        if entry is not None:
            return Route(entry, target, None, alias_of)
        parent = self._adapter_parent.get(target)
        if parent is not None and parent in self.entries:
            return Route(self.entries[parent], target, target, alias_of)
        return None

    def offline(self, name: str, renderer: Renderer | None, block_size: int) -> Route:
        """A route outside the registry: a gateway without replicas (``prefix-router
        explain``) renders with the tokenizer it was given; a model the replicas serve that
        the registry has not seen yet is matched by the text prefix until it has."""
        target = self.aliases.get(name, name)
        key = (target, renderer is not None, block_size)
        entry = self._offline.get(key)
        if entry is None:
            spec = self.specs.get(target)
            entry = ModelEntry(
                target,
                renderer=renderer,
                tokenizer_origin="injected" if renderer is not None else "none",
                block_size=spec.block_size if spec and spec.block_size else block_size,
                block_size_origin="config" if spec and spec.block_size else "flag",
            )
            self._offline[key] = entry
        parent = self._adapter_parent.get(target)
        return Route(entry, target, target if parent else None, name if target != name else None)

    def entry_of_replica(self, url: str) -> ModelEntry | None:
        """The model a replica is routed for (its base model's entry)."""
        for entry in self.entries.values():
            if url in entry.replicas or url in entry.apart:
                return entry
        return None

    def offline_default(self) -> str:
        """The model a body without ``model`` names on a gateway without replicas: the one
        configured under models:, or the one the bundled tokenizer given is for."""
        if len(self.specs) == 1:
            return next(iter(self.specs))
        return model_for_tokenizer(self.flag_tokenizer) or ""

    def default(self) -> ModelEntry | None:
        """The model a request without ``model`` gets (vLLM serves its one model then)."""
        return self.entries[min(self.entries)] if self.entries else None

    def alias(self, name: str) -> str:
        return self.aliases.get(name, name)

    def describe(self) -> dict[str, Any]:
        return {name: e.describe() for name, e in sorted(self.entries.items())}
