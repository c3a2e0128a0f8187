"""The tenancy table: the keys file (or inline config) read and checked into key digests,
tenants with their policies, salt secrets on a rotation schedule, and named public prefixes.
``Tenancy`` (router/tenancy/tenants.py) holds one and answers per request from it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from router.config import Config, ConfigError
from router.flow.settings import FlowSettings, parse_flow

log = logging.getLogger("prefix_router.tenancy")

DEFAULT_TENANT = "default"
POLICIES = ("none", "tenant", "tenant+client", "reject", "passthrough")
# A secret's epoch label goes into every salt, so it must keep the salt valid for vLLM.
_EPOCH_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
# Body fields that steer vLLM's engine rather than ask it something (its chat, completions
# and Responses requests, vllm/entrypoints/openai/protocol.py in v0.34): ``priority`` (with
# --scheduling-policy priority it reorders the replica's queue, over the gateway's bands),
# ``kv_transfer_params`` (disaggregated prefill: which KV to pull from where; only the
# gateway, or a tenant the table trusts, sets it) and ``vllm_xargs`` (arguments for custom
# logits processors and plugins). With auth on a tenant sends one only if its entry's
# ``allow_fields`` lists it.
ENGINE_FIELDS = ("priority", "kv_transfer_params", "vllm_xargs")
# A band's vLLM ``priority`` when the gateway sets it (flow_band_priority): lower runs first.
BAND_PRIORITY = {"critical": -1, "standard": 0, "sheddable": 1}


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class TenantPolicy:
    name: str
    salt_policy: str
    public_prefixes: tuple[str, ...] = ()
    flow: FlowSettings = FlowSettings()  # weight, band, rate limits (router/flow/)
    allow_fields: frozenset[str] = frozenset()  # ENGINE_FIELDS it may send (auth on)
    models: frozenset[str] | None = None  # the models and adapters it may use (None: all)


@dataclass(frozen=True, slots=True)
class SaltSecret:
    """One secret of a rotation schedule: in force from ``not_before`` (epoch seconds)."""

    value: bytes
    not_before: float = 0.0
    epoch: str = "0"


@dataclass
class TenantTable:
    """Everything the keys file says: key digests, tenants, secrets, public prefixes."""

    keys: dict[str, str] = field(default_factory=dict)  # sha256(key) -> tenant
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    secrets: list[SaltSecret] = field(default_factory=list)  # newest first
    public_prefixes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _parse_time(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.replace(tzinfo=value.tzinfo or timezone.utc).timestamp()
    try:
        text = str(value).replace("Z", "+00:00")
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"salt secret 'not_before' must be an ISO time, got {value!r}") from None
    return dt.replace(tzinfo=dt.tzinfo or timezone.utc).timestamp()


# The example manifests' placeholders (deploy/kubernetes/router-secret.yaml): applied as
# written they would make a guessable salt secret and a published API key.
PLACEHOLDER = "REPLACE-ME"
PLACEHOLDER_DIGESTS = frozenset(
    {"bfc4f67fb3e4f34154abb053f263c8a65fa861d034fbfbe4e864e15c57b2baba"}  # ...-of-tenant-b
)


def _refuse_placeholder(value: str, what: str, where: str, fix: str) -> None:
    if PLACEHOLDER in value.upper() or value.lower() in PLACEHOLDER_DIGESTS:
        raise ConfigError(
            f"{where}: {what} is still the example's {PLACEHOLDER} placeholder; {fix}"
        )


def _parse_secrets(raw: Any, where: str) -> list[SaltSecret]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [{"secret": raw}]
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: salt_secrets must be a list of {{secret, not_before}}")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            item = {"secret": item}
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("secret"), str)
            or len(item["secret"]) < 16
        ):
            raise ConfigError(
                f"{where}: salt_secrets[{i}] needs a secret of at least 16 characters"
            )
        _refuse_placeholder(
            item["secret"], "the salt secret", where, "set it to the output of openssl rand -hex 32"
        )
        epoch = str(item.get("epoch", i))
        if not _EPOCH_RE.fullmatch(epoch):
            # The epoch is part of every salt sent: it must keep the salt valid for vLLM.
            raise ConfigError(
                f"{where}: salt_secrets[{i}].epoch must be 1-32 characters of A-Z a-z 0-9 . _ -"
            )
        out.append(
            SaltSecret(item["secret"].encode(), _parse_time(item.get("not_before", 0)), epoch)
        )
    return sorted(out, key=lambda s: s.not_before, reverse=True)


def _normalise_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        messages = [{"role": "system", "content": messages}]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ConfigError(
            f"{where}: a public prefix is a system prompt string or a list of messages"
        )
    return messages


def _read_keys_file(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"api_keys_file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"api_keys_file {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        # Only the position: PyYAML's message quotes the offending line, which may hold a key.
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"api_keys_file {path} is not valid YAML{at}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"api_keys_file {path} must be a mapping")
    return loaded


def _names(value: Any, what: str, where: str) -> list[str]:
    """A list of strings (a single string is a list of one, not a list of characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
        raise ConfigError(f"{where}: {what} must be a list of strings")
    return [str(v) for v in value]


def _mapping(value: Any, what: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {what} must be a mapping")
    return value


def load_table(config: Config, env: Mapping[str, str] | None = None) -> TenantTable:
    """Build the table from the keys file, the config and ``PREFIX_ROUTER_API_KEYS``."""
    env = os.environ if env is None else env
    table = TenantTable()
    data = _read_keys_file(Path(config.auth.api_keys_file)) if config.auth.api_keys_file else {}
    where = config.auth.api_keys_file or "config"
    file_tenants = _mapping(data.get("tenants"), "tenants", where)
    config_tenants = _mapping(config.auth.tenants, "tenants", "config")
    default_policy = default_salt_policy(config)

    def add_key(digest: str, tenant: str) -> None:
        _refuse_placeholder(
            digest, f"tenant {tenant!r}'s key_sha256", where, "hash the tenant's real key"
        )
        other = table.keys.get(digest)
        if other is not None and other != tenant:
            # Never name the key itself: only who it collides between.
            raise ConfigError(f"{where}: one API key is given to tenants {other!r} and {tenant!r}")
        table.keys[digest] = tenant

    for name in {**file_tenants, **config_tenants}:
        # The config's entry for a tenant overrides single fields of the file's, so a
        # policy override there does not drop the tenant's keys.
        parts = [file_tenants.get(name), config_tenants.get(name)]
        if not all(p is None or isinstance(p, dict) for p in parts):
            raise ConfigError(f"{where}: tenant {name!r} must be a mapping")
        spec: dict[str, Any] = {**(parts[0] or {}), **(parts[1] or {})}
        policy = spec.get("salt_policy", default_policy)
        if policy not in POLICIES:
            raise ConfigError(
                f"{where}: tenant {name!r}: salt_policy must be one of {', '.join(POLICIES)}"
            )
        fields = _names(spec.get("allow_fields"), f"tenant {name!r}: allow_fields", where)
        unknown = sorted(set(fields) - set(ENGINE_FIELDS))
        if unknown:
            raise ConfigError(
                f"{where}: tenant {name!r}: allow_fields takes {', '.join(ENGINE_FIELDS)}; "
                f"not {', '.join(unknown)}"
            )
        models = spec.get("models")
        table.tenants[str(name)] = TenantPolicy(
            str(name),
            policy,
            tuple(_names(spec.get("public_prefixes"), "public_prefixes", where)),
            parse_flow(spec, f"{where}: tenant {name!r}"),
            frozenset(fields),
            None
            if models is None
            else frozenset(_names(models, f"tenant {name!r}: models", where)),
        )
        for key in _names(spec.get("keys"), f"tenant {name!r}: keys", where):
            _refuse_placeholder(key, f"tenant {name!r}'s API key", where, "give it a real key")
            add_key(key_digest(key), str(name))
        for digest in _names(spec.get("key_sha256"), f"tenant {name!r}: key_sha256", where):
            digest = digest.strip().lower()
            if not _DIGEST_RE.fullmatch(digest):
                raise ConfigError(
                    f"{where}: tenant {name!r}: key_sha256 entries are 64 hex digits "
                    "(sha256sum of the key)"
                )
            add_key(digest, str(name))
    for pair in filter(None, (env.get("PREFIX_ROUTER_API_KEYS") or "").split(",")):
        name, sep, key = pair.partition(":")
        name, key = name.strip(), key.strip()
        if not sep or not key or not name:
            raise ConfigError("PREFIX_ROUTER_API_KEYS must be tenant:key[,tenant:key...]")
        _refuse_placeholder(
            key, f"tenant {name!r}'s API key", "PREFIX_ROUTER_API_KEYS", "give it a real key"
        )
        add_key(key_digest(key), name)
        table.tenants.setdefault(name, TenantPolicy(name, default_policy))
    secrets = _parse_secrets(data.get("salt_secrets"), where)
    if config.auth.salt_secret:
        secrets += _parse_secrets(config.auth.salt_secret, "salt_secret")
        secrets.sort(key=lambda s: s.not_before, reverse=True)
    table.secrets = secrets
    prefixes = {
        **_mapping(data.get("public_prefixes"), "public_prefixes", where),
        **_mapping(config.auth.public_prefixes, "public_prefixes", "config"),
    }
    for pname, messages in prefixes.items():
        table.public_prefixes[str(pname)] = _normalise_messages(messages, f"{where}: {pname}")
    for t in table.tenants.values():
        for p in t.public_prefixes:
            if p not in table.public_prefixes:
                raise ConfigError(f"{where}: tenant {t.name!r} shares unknown public prefix {p!r}")
    check_table(config, table)
    return table


def check_table(config: Config, table: TenantTable) -> None:
    """What a table needs to serve: a secret if any policy salts, keys if auth is on. Every
    missing setting is reported at once."""
    default_policy = default_salt_policy(config)
    policies = {default_policy, *(t.salt_policy for t in table.tenants.values())}
    problems = []
    if config.auth.enabled and "passthrough" in policies:
        # With auth on, a forwarded client salt could name another tenant's scope.
        problems.append(
            "salt_policy passthrough is for auth off only; with auth on use tenant, "
            "tenant+client, reject or none"
        )
    if policies - {"passthrough"} and not table.secrets:
        problems.append(
            "the salt policy needs a server secret: set salt_secret "
            "(PREFIX_ROUTER_SALT_SECRET) or salt_secrets in api_keys_file"
        )
    if config.auth.enabled and not table.keys:
        problems.append(
            "auth is on but no API keys are configured (api_keys_file or PREFIX_ROUTER_API_KEYS)"
        )
    if problems:
        raise ConfigError(problems)


def default_salt_policy(config: Config) -> str:
    if config.auth.salt_policy != "auto":
        if config.auth.salt_policy not in POLICIES:
            raise ConfigError(f"salt_policy must be auto or one of {', '.join(POLICIES)}")
        return config.auth.salt_policy
    return "tenant" if config.auth.enabled else "passthrough"
