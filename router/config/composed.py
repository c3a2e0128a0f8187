"""The whole configuration: ``Config`` holds one section of each type (router/config/sections.py),
and ``FIELDS`` maps every flat name (``redis_url``, the flag's and the YAML key's) to its place."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from router.config.disaggregation import Disaggregation
from router.config.sections import (
    Auth,
    Discovery,
    Fleet,
    Flow,
    Forwarding,
    Health,
    KvEvents,
    Limits,
    Registry,
    Routing,
    Server,
)
from router.core.urls import mask_url_credentials


@dataclass
class Config:
    """The whole configuration, by section (``router.config.load_config`` builds it)."""

    server: Server = field(default_factory=Server)
    routing: Routing = field(default_factory=Routing)
    health: Health = field(default_factory=Health)
    forwarding: Forwarding = field(default_factory=Forwarding)
    limits: Limits = field(default_factory=Limits)
    fleet: Fleet = field(default_factory=Fleet)
    kv_events: KvEvents = field(default_factory=KvEvents)
    discovery: Discovery = field(default_factory=Discovery)
    disaggregation: Disaggregation = field(default_factory=Disaggregation)
    auth: Auth = field(default_factory=Auth)
    registry: Registry = field(default_factory=Registry)
    flow: Flow = field(default_factory=Flow)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> Config:
        """From flat names (``{"redis_url": ...}``), every other field at its default."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            ref = FIELDS[name]
            by_section.setdefault(ref.section, {})[ref.attr] = value
        return cls(**{s: SECTION_TYPES[s](**kw) for s, kw in by_section.items()})

    def get(self, name: str) -> Any:
        """A field's value by its flat name."""
        ref = FIELDS[name]
        return getattr(getattr(self, ref.section), ref.attr)

    def redacted(self) -> dict[str, Any]:
        """The effective config as a dict of flat names, with secrets masked (safe to print or
        log)."""
        out = {}
        for name, ref in FIELDS.items():
            value = self.get(name)
            if ref.field.metadata.get("secret") and value:
                value = "***"
            elif isinstance(value, str):
                value = mask_url_credentials(value)
            elif isinstance(value, list):
                value = [mask_url_credentials(v) if isinstance(v, str) else v for v in value]
            out[name] = value
        return out


SECTION_TYPES: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


@dataclass(frozen=True)
class FieldRef:
    """Where a flat name lives: ``config.<section>.<attr>``, its field and type."""

    section: str
    attr: str
    field: dataclasses.Field[Any]
    type: Any


def _field_refs() -> dict[str, FieldRef]:
    out: dict[str, FieldRef] = {}
    for section, cls in SECTION_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f.metadata.get("flat") or f.name
            out[name] = FieldRef(section, f.name, f, hints[f.name])
    return out


FIELDS: dict[str, FieldRef] = _field_refs()
