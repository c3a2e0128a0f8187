"""Plugins and policies by name. Registration is one decorator line; ``build`` turns a spec
(names, parameters, weights) into a ``Pipeline``. Names listed anywhere (config validation, CLI
help, the load tests) come from here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from router.schedule.pipeline import Pipeline
from router.schedule.ring import RingSource
from router.schedule.types import ScheduleError, check_plugin, parse_params

Kind = Literal["filter", "scorer", "picker"]
_PLUGINS: dict[Kind, dict[str, type[Any]]] = {"filter": {}, "scorer": {}, "picker": {}}
_POLICIES: dict[str, type[Any]] = {}
DEFAULT_POLICY = "ring_spill"  # docs/scheduling.md: the pressure and light-load figures

T = TypeVar("T", bound=type[Any])


def _register(kind: Kind, name: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        if name in _PLUGINS[kind]:
            raise ValueError(f"{kind} {name!r} is registered twice")
        if getattr(cls, "name", name) != name:
            raise ValueError(f"{kind} {cls.__name__} says its name is {cls.name!r}, not {name!r}")
        cls.name = name
        _PLUGINS[kind][name] = cls
        return cls

    return deco


def filter(name: str) -> Callable[[T], T]:
    return _register("filter", name)


def scorer(name: str) -> Callable[[T], T]:
    return _register("scorer", name)


def picker(name: str) -> Callable[[T], T]:
    return _register("picker", name)


def policy(name: str) -> Callable[[T], T]:
    """Register a named policy: a params dataclass whose ``profile()`` composes plugins."""

    def deco(cls: T) -> T:
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} is registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def names(kind: Kind) -> list[str]:
    return sorted(_PLUGINS[kind])


def policy_names() -> list[str]:
    """Every registered policy, the default first."""
    return sorted(_POLICIES, key=lambda n: (n != DEFAULT_POLICY, n))


@dataclass(frozen=True)
class PluginSpec:
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0  # scorers only


@dataclass(frozen=True)
class ProfileSpec:
    filters: tuple[PluginSpec, ...]
    scorers: tuple[PluginSpec, ...]
    picker: PluginSpec


class PolicyParams(Protocol):
    def profile(self) -> ProfileSpec: ...


def plugin(kind: Kind, spec: PluginSpec, where: str = "schedule") -> Any:
    try:
        cls = _PLUGINS[kind][spec.name]
    except KeyError:
        raise ScheduleError(
            f"{where}: unknown {kind} {spec.name!r}; choose from {', '.join(names(kind))}"
        ) from None
    built = cls(parse_params(cls.Params, spec.params, f"{where}: {kind} {spec.name}"))
    check_plugin(built, kind, where)
    return built


def build(
    spec: ProfileSpec, ring: RingSource, name: str = "custom", where: str = "schedule"
) -> Pipeline:
    """A pipeline from a profile. Scorers of weight 0 are left out: they cannot change a
    cost, and their terms would only be noise in explain."""
    filters = [plugin("filter", f, where) for f in spec.filters]
    scorers = []
    for s in spec.scorers:
        built = plugin("scorer", s, where)  # checked even when weighted 0
        if s.weight:
            scorers.append((built, float(s.weight)))
    return Pipeline(name, ring, filters, scorers, plugin("picker", spec.picker, where))


def policy_params(
    name: str,
    params: Mapping[str, Any] | None = None,
    knobs: Mapping[str, Any] | None = None,
    where: str = "schedule",
) -> PolicyParams:
    """The named policy's parameters. ``params`` are strict (an unknown name is an error);
    ``knobs`` (the fleet-wide ``--load-bound`` / ``--decode-cost-tokens``) apply where the
    policy has a parameter of that name, under ``params``."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown policy {name!r}; choose from {', '.join(policy_names())}"
        ) from None
    fields = set(cls.__dataclass_fields__)
    merged = {k: v for k, v in (knobs or {}).items() if k in fields}
    merged.update(params or {})
    result: PolicyParams = parse_params(cls, merged, f"{where}: policy {name}")
    return result


def build_named(
    name: str,
    ring: RingSource,
    params: Mapping[str, Any] | None = None,
    knobs: Mapping[str, Any] | None = None,
    where: str = "schedule",
) -> Pipeline:
    profile = policy_params(name, params, knobs, where).profile()
    return build(profile, ring, name, where)
