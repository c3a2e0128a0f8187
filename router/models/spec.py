"""The operator's word on each model: the ``models:`` section of the config file.

    models:
      meta-llama/Llama-3.1-8B-Instruct:
        tokenizer: /models/llama-3.1-8b          # a directory, or a model id in the HF cache
        chat_template: /etc/router/llama.jinja   # optional: the replicas' --chat-template
        block_size: 32                           # optional: must agree with the replicas
        aliases: [claude-3-5-haiku-latest]       # client-facing names for this model
        adapters: {sql-lora: /adapters/sql}      # LoRA adapters the gateway may load at run time

Everything is optional; a model absent here is found from what its replicas report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_KEYS = frozenset(
    {"tokenizer", "chat_template", "block_size", "aliases", "adapters", "chat_template_kwargs"}
)


class ModelSpecError(ValueError):
    """A ``models:`` entry that cannot be used, phrased for the person who wrote it."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    tokenizer: str | None = None
    chat_template: str | None = None  # a file holding the template the replicas use
    block_size: int | None = None
    aliases: tuple[str, ...] = ()
    adapters: Mapping[str, str] = field(default_factory=dict)  # runtime-loadable LoRA: name -> path
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def parse_models(raw: Mapping[str, Any] | None) -> dict[str, ModelSpec]:
    """``models:`` -> one spec per served model name; a clear error for anything unusable."""
    specs: dict[str, ModelSpec] = {}
    for name, entry in (raw or {}).items():
        where = f"models.{name}"
        if not isinstance(name, str) or not name:
            raise ModelSpecError("models: every key must be a served model name")
        if entry is None:
            entry = {}
        if isinstance(entry, str):  # shorthand: name -> tokenizer
            entry = {"tokenizer": entry}
        if not isinstance(entry, Mapping):
            raise ModelSpecError(f"{where}: expected a mapping or a tokenizer path")
        unknown = set(entry) - _KEYS
        if unknown:
            raise ModelSpecError(
                f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})"
            )
        bs = entry.get("block_size")
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ModelSpecError(f"{where}.block_size must be a positive integer, got {bs!r}")
        aliases = entry.get("aliases") or []
        if isinstance(aliases, str):
            aliases = [aliases]
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ModelSpecError(f"{where}.aliases must be a list of names")
        adapters = entry.get("adapters") or {}
        if not isinstance(adapters, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in adapters.items()
        ):
            raise ModelSpecError(f"{where}.adapters must map adapter names to paths")
        kwargs = entry.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ModelSpecError(f"{where}.chat_template_kwargs must be a mapping")
        for key in ("tokenizer", "chat_template"):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                raise ModelSpecError(f"{where}.{key} must be a string")
        specs[name] = ModelSpec(
            name=name,
            tokenizer=entry.get("tokenizer"),
            chat_template=entry.get("chat_template"),
            block_size=bs,
            aliases=tuple(aliases),
            adapters=dict(adapters),
            chat_template_kwargs=dict(kwargs),
        )
    return specs


def alias_map(specs: Mapping[str, ModelSpec], extra: Mapping[str, Any] | None) -> dict[str, str]:
    """Client-facing name -> served model, from each spec's ``aliases`` and ``model_aliases``.
    A name that is itself a configured model, or that two models claim, is refused."""
    out: dict[str, str] = {}

    def add(alias: str, target: str, where: str) -> None:
        if not isinstance(target, str) or not target:
            raise ModelSpecError(f"{where}: the target must be a model name")
        if alias in specs:
            raise ModelSpecError(f"{where}: {alias!r} is a configured model, not an alias")
        if out.get(alias, target) != target:
            raise ModelSpecError(
                f"{where}: {alias!r} is an alias of both {out[alias]!r} and {target!r}"
            )
        out[alias] = target

    for spec in specs.values():
        for alias in spec.aliases:
            add(alias, spec.name, f"models.{spec.name}.aliases")
    for alias, target in (extra or {}).items():
        add(str(alias), target, f"model_aliases.{alias}")
    return out


def adapter_paths(specs: Mapping[str, ModelSpec]) -> dict[str, tuple[str, str]]:
    """Runtime-loadable adapters: name -> (base model, path)."""
    return {name: (s.name, path) for s in specs.values() for name, path in s.adapters.items()}
