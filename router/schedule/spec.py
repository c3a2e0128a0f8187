"""The config's ``schedule:`` mapping: a named policy with parameters, or a full profile.

    schedule: {policy: ttft, params: {load_bound: 1.5, kv_pressure: 2000}}
    schedule:
      name: my_profile                       # optional, default "custom"
      filters: [load_bound, {name: recent_share, params: {min_recent: 32}}]
      scorers: [uncached_prefill, {name: inflight, weight: 8}]
      picker: ring_min_cost

``policy``, ``load_bound`` and ``decode_cost_tokens`` are also top-level settings (flags,
environment): ``lift`` gives the file's ``schedule`` values to them at the file's precedence,
so a flag still wins; ``from_config`` then builds what is in force. The fleet-wide knobs apply
to named policies only; a profile sets its plugins' parameters itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import router.schedule.registry as registry
from router.schedule.pipeline import Pipeline
from router.schedule.registry import PluginSpec, ProfileSpec
from router.schedule.ring import HashRing, RingSource
from router.schedule.types import ScheduleError


class Settings(Protocol):
    """What the scheduling reads of the config (``router.config.Config`` has it; this
    package does not import the config, which imports it)."""

    schedule: dict[str, Any]
    policy: str
    load_bound: float
    decode_cost_tokens: float


KNOBS = ("load_bound", "decode_cost_tokens")
PROFILE_KEYS = ("filters", "scorers", "picker")
KEYS = ("policy", "params", "name", *PROFILE_KEYS)
WHERE = "schedule"


def is_profile(schedule: Mapping[str, Any]) -> bool:
    return any(k in schedule for k in PROFILE_KEYS)


def lift(schedule: Any) -> dict[str, Any]:
    """The top-level settings a file's ``schedule`` gives: ``policy`` (a profile's name for a
    profile) and the knobs among ``params``. Checks the shape; the content is checked when
    the config is validated."""
    if not isinstance(schedule, Mapping):
        raise ScheduleError(f"{WHERE} must be a mapping, got {schedule!r}")
    unknown = sorted(set(map(str, schedule)) - set(KEYS))
    if unknown:
        raise ScheduleError(f"{WHERE}: unknown key {unknown[0]!r}; valid: {', '.join(KEYS)}")
    if is_profile(schedule):
        if "policy" in schedule or "params" in schedule:
            raise ScheduleError(
                f"{WHERE}: give a policy (with params) or a profile (filters, scorers, "
                "picker), not both"
            )
        name = str(schedule.get("name", "custom"))
        if name in registry.policy_names():
            raise ScheduleError(f"{WHERE}: name {name!r} is a built-in policy; choose another")
        return {"policy": name}
    if "name" in schedule:
        raise ScheduleError(f"{WHERE}: name is for a profile (filters, scorers, picker)")
    params = schedule.get("params") or {}
    if not isinstance(params, Mapping):
        raise ScheduleError(f"{WHERE}: params must be a mapping, got {params!r}")
    out = {k: params[k] for k in KNOBS if k in params}
    if "policy" in schedule:
        out["policy"] = str(schedule["policy"])
    return out


def _entry(item: Any, kind: str, scorer: bool = False) -> PluginSpec:
    if isinstance(item, str):
        return PluginSpec(item)
    allowed = ("name", "params", "weight") if scorer else ("name", "params")
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        raise ScheduleError(f"{WHERE}: a {kind} is a name or {{name: ..., params: {{...}}}}")
    extra = sorted(set(item) - set(allowed))
    if extra:
        raise ScheduleError(
            f"{WHERE}: {kind} {item['name']}: unknown key {extra[0]!r}; valid: {', '.join(allowed)}"
        )
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ScheduleError(
            f"{WHERE}: scorer {item['name']}: weight must be a number >= 0, got {weight!r}"
        )
    return PluginSpec(item["name"], item.get("params") or {}, float(weight))


def profile_of(schedule: Mapping[str, Any]) -> ProfileSpec:
    if "picker" not in schedule:
        raise ScheduleError(
            f"{WHERE}: a profile needs a picker; choose from {', '.join(registry.names('picker'))}"
        )
    lists = {}
    for key in ("filters", "scorers"):
        items = schedule.get(key) or []
        if not isinstance(items, list):
            raise ScheduleError(f"{WHERE}: {key} must be a list")
        lists[key] = tuple(_entry(i, key[:-1], scorer=key == "scorers") for i in items)
    return ProfileSpec(lists["filters"], lists["scorers"], _entry(schedule["picker"], "picker"))


def from_config(config: Settings, ring: RingSource) -> Pipeline:
    """The pipeline the config puts in force."""
    schedule = config.schedule or {}
    if is_profile(schedule) and config.policy == schedule.get("name", "custom"):
        return registry.build(profile_of(schedule), ring, config.policy)
    knobs = {"load_bound": config.load_bound, "decode_cost_tokens": config.decode_cost_tokens}
    params: dict[str, Any] = {}
    if schedule.get("policy", config.policy) == config.policy:  # not overridden by a flag
        params = dict(schedule.get("params") or {})
        for k in KNOBS:
            if k in params:  # lifted into the setting, which a flag or env may have changed
                params[k] = knobs[k]
    return registry.build_named(config.policy, ring, params, knobs)


def check_config(config: Settings) -> None:
    """Raise ``ScheduleError`` unless ``from_config`` would succeed."""
    from_config(config, HashRing())
