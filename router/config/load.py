"""Reading the configuration: defaults < a YAML file < environment < flags < overrides.

Every field has a flat name that is a flag (``--block-size``), a config key (``block_size``)
and an environment variable (``PREFIX_ROUTER_BLOCK_SIZE``; lists comma-separated). A YAML file
may also group keys by section (``routing: {block_size: 32}``), the sections of ``Config``.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import yaml

from router.config.checks import problems as check_problems
from router.config.composed import FIELDS, SECTION_TYPES, Config
from router.config.errors import ConfigError, did_you_mean
from router.schedule import ScheduleError
from router.schedule.spec import lift as lift_schedule

ENV_PREFIX = "PREFIX_ROUTER_"
# Lists given one item a flag: ``--replica URL --replica URL``.
REPEATED_FLAGS = {
    "replicas": "--replica",
    "prefill_replicas": "--prefill-replica",
    "decode_replicas": "--decode-replica",
}


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the concrete type, whether None is allowed) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(name: str, value: Any, source: str) -> Any:
    base, nullable = _base_type(FIELDS[name].type)
    if value is None or (nullable and isinstance(value, str) and value.lower() in ("", "none")):
        if nullable:
            return None
        raise ConfigError(f"{source}: {name} must not be empty")
    origin = typing.get_origin(base) or base
    try:
        if origin is list:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [str(i).strip() for i in items if str(i).strip()]
        if origin is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {name} must be a mapping")
            return value
        if origin is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if origin is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if origin is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}: {name} must be {getattr(origin, '__name__', origin)}, got {value!r}"
        ) from None


def _readable(name: str, default: Any) -> str:
    """A default as a person reads it: byte sizes in MiB/KiB (33554432 -> 32 MiB)."""
    if name.endswith("_bytes") and isinstance(default, int) and default >= 1024:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default % size == 0:
                return f"{default // size} {unit} = {default}"
    return str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so only flags the user gave override."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (keys as the long flags, with underscores)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (secrets masked) and exit",
    )
    for name, ref in FIELDS.items():
        f = ref.field
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + name.replace("_", "-")
        base, _ = _base_type(ref.type)
        env = ENV_PREFIX + name.upper()
        default = f.default if f.default is not MISSING else None
        shown = (
            ""
            if f.metadata.get("secret") or default in (None, [], {})
            else f" (default: {_readable(name, default)})"
        )
        help_text = f"{f.metadata['help']}{shown} [env {env}]"
        if name in REPEATED_FLAGS:
            parser.add_argument(
                REPEATED_FLAGS[name],
                dest=name,
                action="append",
                metavar="URL",
                default=None,
                help=help_text,
            )
        elif (typing.get_origin(base) or base) is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


# The file's sections are Config's: ``fleet: {redis_url: ...}`` sets what the flat key
# ``redis_url`` sets (flags and PREFIX_ROUTER_* names stay flat). Inside a section a key may
# drop the section's prefix (``kv_events: {port: 5557}``), and ``enabled`` is the switch the
# section is named after.
@dataclass(frozen=True)
class Section:
    fields: tuple[str, ...]  # flat names, the switch's too
    prefix: str = ""  # dropped from a field's name inside the section
    enabled: str | None = None  # the flat name ``enabled:`` sets
    suffix: str = ""  # dropped too (``disaggregation: {prefill: [...]}``)

    def keys(self) -> dict[str, str]:
        """Key inside the section -> flat name."""
        out = {name: name for name in self.fields}
        out.update(
            {n.removeprefix(self.prefix): n for n in self.fields if n.startswith(self.prefix)}
        )
        if self.suffix:
            out.update(
                {n.removesuffix(self.suffix): n for n in self.fields if n.endswith(self.suffix)}
            )
        if self.enabled:
            out["enabled"] = self.enabled
        return out


_PREFIXES = {
    "fleet": "redis_",
    "kv_events": "kv_events_",
    "discovery": "discovery_",
    "flow": "flow_",
    "disaggregation": "pd_",
}
_SUFFIXES = {"disaggregation": "_replicas"}


def _sections() -> dict[str, Section]:
    out = {}
    for section in SECTION_TYPES:
        names = tuple(n for n, ref in FIELDS.items() if ref.section == section)
        switch = next((n for n in names if FIELDS[n].attr == "enabled"), None)
        out[section] = Section(
            names, _PREFIXES.get(section, ""), switch, _SUFFIXES.get(section, "")
        )
    return out


SECTIONS: dict[str, Section] = _sections()


def _flatten(data: dict[Any, Any], path: str, problems: list[str]) -> dict[str, Any]:
    """The file's keys as flat names: sections opened, aliases resolved, unknown keys
    reported."""
    out: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(name: str, value: Any, key: str) -> None:
        if name in out:
            problems.append(f"{path}: {name} is set twice ({where[name]} and {key})")
            return
        out[name], where[name] = value, key

    for key, value in data.items():
        name = str(key).replace("-", "_")
        section = SECTIONS.get(name)
        if section is not None and isinstance(value, dict):
            inner = section.keys()
            for k, v in value.items():
                kname = str(k).replace("-", "_")
                if kname in inner:
                    put(inner[kname], v, f"{name}.{k}")
                else:
                    hint = did_you_mean(kname, inner)
                    problems.append(f"{path}: unknown key {k!r} in section {name!r}{hint}")
            continue
        if name == "replica":
            name = "replicas"
        if name in FIELDS:
            put(name, value, str(key))
        else:
            hint = did_you_mean(name, [*FIELDS, *SECTIONS])
            problems.append(f"{path}: unknown key {key!r}{hint}")
    return out


def load_config(
    args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **overrides: Any
) -> Config:
    """Defaults < ``--config`` file < ``PREFIX_ROUTER_*`` environment < flags < overrides (flat
    names). Every problem found is reported at once, in one ConfigError."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    problems: list[str] = []

    def coerce(name: str, value: Any, source: str) -> None:
        try:
            values[name] = _coerce(name, value, source)
        except ConfigError as e:
            problems.extend(e.problems)

    path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must be a mapping of keys to values")
        for name, value in _flatten(data, path, problems).items():
            coerce(name, value, path)
        if "schedule" in values:  # its policy and knobs are the top-level settings too
            try:
                lifted = lift_schedule(values["schedule"])
            except ScheduleError as e:
                problems.append(f"{path}: {e}")
                lifted = {}
            for name, value in lifted.items():
                try:
                    same = name not in values or values[name] == _coerce(name, value, path)
                except ConfigError as e:
                    problems.extend(e.problems)
                    continue
                if not same:
                    problems.append(f"{path}: {name} is set twice (at top level and in schedule)")
                coerce(name, value, path)

    for name in FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            coerce(name, env[key], f"environment {key}")

    if args is not None:
        for name in FIELDS:
            value = getattr(args, name, None)
            if value is not None:
                coerce(name, value, "--" + name.replace("_", "-"))

    for name, value in overrides.items():
        if name not in FIELDS:
            problems.append(f"unknown config key {name!r}{did_you_mean(name, FIELDS)}")
            continue
        values[name] = value
    config = Config.from_flat(values)
    problems += check_problems(config)
    if problems:
        raise ConfigError(problems)
    return config


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.redacted(), sort_keys=False)
