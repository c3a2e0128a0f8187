"""Who is calling, and which ``cache_salt`` their requests carry.

vLLM shares cached blocks between any two requests with the same prefix; ``cache_salt``
(folded into block 0) is how a tenant's prefixes are kept apart, which also closes the timing
side channel of CVE-2025-46570. The gateway derives salts from an authenticated identity, never
from anything a client can choose freely:

- ``none``          the tenant shares the fleet cache; a client salt is only honoured inside a
                    public scope (``HMAC(secret, public, salt)``), so it cannot reach a tenant's.
- ``tenant``        ``HMAC(secret, tenant)``, replacing whatever the client sent.
- ``tenant+client`` ``HMAC(secret, tenant, client_salt)``: a client can split its own users
                    further, never step outside its tenant.
- ``reject``        a client-sent salt is a 400; requests carry the tenant salt.
- ``passthrough``   (auth off, no policy set) the client's salt is forwarded as is.

Named public prefixes: a request whose leading messages equal a published prefix (say, a
public system prompt) is sent unsalted by tenants allowed to share it. Salting re-keys the
whole request, so the only way to share the public part is to send the whole request
unsalted: its private continuation is then as visible to timing probes as in an unsalted
fleet. That is the trade-off to accept per tenant.

The salt the gateway sends is the salt it hashes blocks with, so routing and the engine
separate tenants in exactly the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from router.config import Config, ConfigError
from router.errors import APIError, bad_request

log = logging.getLogger("prefix_router.tenancy")

DEFAULT_TENANT = "default"
POLICIES = ("none", "tenant", "tenant+client", "reject", "passthrough")


def validate_salt(salt: object) -> str:
    """vLLM's rule: a non-empty string of at most 128 characters without ``@ / \\`` or NUL."""
    if not isinstance(salt, str) or not salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    if len(salt) > 128:
        raise bad_request("cache_salt must be at most 128 characters", "cache_salt")
    if any(ch in salt for ch in "@/\\\x00"):
        raise bad_request("cache_salt must not contain '@', '/', '\\' or NUL", "cache_salt")
    return salt


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SaltDecision:
    salt: str | None
    policy: str
    public_prefix: str | None = None


@dataclass
class TenantPolicy:
    name: str
    salt_policy: str
    public_prefixes: tuple[str, ...] = ()


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
        out.append(
            SaltSecret(
                item["secret"].encode(),
                _parse_time(item.get("not_before", 0)),
                str(item.get("epoch", i)),
            )
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


def load_table(config: Config, env: Mapping[str, str] | None = None) -> TenantTable:
    """Build the table from the keys file, the config and ``PREFIX_ROUTER_API_KEYS``."""
    env = os.environ if env is None else env
    table = TenantTable()
    data: dict[str, Any] = {}
    if config.api_keys_file:
        path = Path(config.api_keys_file)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"api_keys_file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"api_keys_file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"api_keys_file {path} must be a mapping")
        data = loaded
    where = config.api_keys_file or "config"
    tenants = {**(data.get("tenants") or {}), **(config.tenants or {})}
    default_policy = default_salt_policy(config)
    for name, spec in tenants.items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: tenant {name!r} must be a mapping")
        policy = spec.get("salt_policy", default_policy)
        if policy not in POLICIES:
            raise ConfigError(
                f"{where}: tenant {name!r}: salt_policy must be one of {', '.join(POLICIES)}"
            )
        table.tenants[str(name)] = TenantPolicy(
            str(name), policy, tuple(spec.get("public_prefixes") or ())
        )
        for key in spec.get("keys") or ():
            table.keys[key_digest(str(key))] = str(name)
        for digest in spec.get("key_sha256") or ():
            table.keys[str(digest).lower()] = str(name)
    for pair in filter(None, (env.get("PREFIX_ROUTER_API_KEYS") or "").split(",")):
        name, sep, key = pair.partition(":")
        if not sep or not key:
            raise ConfigError("PREFIX_ROUTER_API_KEYS must be tenant:key[,tenant:key...]")
        table.keys[key_digest(key.strip())] = name.strip()
        table.tenants.setdefault(name.strip(), TenantPolicy(name.strip(), default_policy))
    secrets = _parse_secrets(data.get("salt_secrets"), where)
    if config.salt_secret:
        secrets += _parse_secrets(config.salt_secret, "salt_secret")
        secrets.sort(key=lambda s: s.not_before, reverse=True)
    table.secrets = secrets
    prefixes = {**(data.get("public_prefixes") or {}), **(config.public_prefixes or {})}
    for pname, messages in prefixes.items():
        table.public_prefixes[str(pname)] = _normalise_messages(messages, f"{where}: {pname}")
    for t in table.tenants.values():
        for p in t.public_prefixes:
            if p not in table.public_prefixes:
                raise ConfigError(f"{where}: tenant {t.name!r} shares unknown public prefix {p!r}")
    return table


def default_salt_policy(config: Config) -> str:
    if config.salt_policy != "auto":
        if config.salt_policy not in POLICIES:
            raise ConfigError(f"salt_policy must be auto or one of {', '.join(POLICIES)}")
        return config.salt_policy
    return "tenant" if config.auth else "passthrough"


class Tenancy:
    """Identifies tenants and decides each request's salt. Reloads the keys file when it
    changes, so keys and secrets roll without a restart."""

    def __init__(self, config: Config, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._env = env
        self.default_policy = default_salt_policy(config)
        self.table = load_table(config, env)
        self._mtime = self._file_mtime()
        self._checked = time.monotonic()
        needs_secret = self.default_policy in ("none", "tenant", "tenant+client", "reject") or any(
            t.salt_policy != "passthrough" for t in self.table.tenants.values()
        )
        if needs_secret and not self.table.secrets:
            raise ConfigError(
                "the salt policy needs a server secret: set salt_secret "
                "(PREFIX_ROUTER_SALT_SECRET) or salt_secrets in api_keys_file"
            )
        if config.auth and not self.table.keys:
            raise ConfigError(
                "auth is on but no API keys are configured (api_keys_file or "
                "PREFIX_ROUTER_API_KEYS)"
            )

    def _file_mtime(self) -> float | None:
        if not self.config.api_keys_file:
            return None
        try:
            return os.stat(self.config.api_keys_file).st_mtime
        except OSError:
            return None

    def maybe_reload(self) -> None:
        """At most once a second, reload the keys file if it changed; keep the old table if
        the new file is broken (and say so once)."""
        now = time.monotonic()
        if now - self._checked < 1.0 or not self.config.api_keys_file:
            return
        self._checked = now
        mtime = self._file_mtime()
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self.table = load_table(self.config, self._env)
            log.info(
                "reloaded %s: %d tenants, %d keys",
                self.config.api_keys_file,
                len(self.table.tenants),
                len(self.table.keys),
            )
        except ConfigError as e:
            log.error("keeping the previous tenants: %s", e)

    # -- identity -------------------------------------------------------------------------
    def identify(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request; a 401 ``APIError`` when auth is on and fails."""
        self.maybe_reload()
        if not self.config.auth:
            if self.config.tenant_header:
                name = headers.get(self.config.tenant_header, "").strip()
                if name and len(name) <= 128 and name.isprintable():
                    return name
            return DEFAULT_TENANT
        auth = headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key"
            )
        # A dict lookup by SHA-256 digest: timing can reveal nothing about the key itself,
        # and the key is never stored, compared or logged in the clear.
        tenant = self.table.keys.get(key_digest(key.strip()))
        if tenant is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def policy_of(self, tenant: str) -> TenantPolicy:
        return self.table.tenants.get(tenant) or TenantPolicy(tenant, self.default_policy)

    # -- salt -----------------------------------------------------------------------------
    def current_secret(self, now: float | None = None) -> SaltSecret | None:
        now = time.time() if now is None else now
        for s in self.table.secrets:  # newest first
            if s.not_before <= now:
                return s
        return self.table.secrets[-1] if self.table.secrets else None

    def _derive(self, *parts: str) -> str:
        secret = self.current_secret()
        assert secret is not None  # checked at start-up
        mac = hmac.new(secret.value, "\x00".join(parts).encode(), hashlib.sha256).hexdigest()
        return f"pr{secret.epoch}-{mac[:48]}"

    def salt(
        self, tenant: str, client_salt: object | None, messages: Sequence[Any] | None = None
    ) -> SaltDecision:
        policy = self.policy_of(tenant)
        if client_salt is not None:
            validate_salt(client_salt)
        name = policy.salt_policy
        if name == "passthrough":
            return SaltDecision(client_salt if isinstance(client_salt, str) else None, name)
        if name == "reject" and client_salt is not None:
            raise bad_request(
                "cache_salt is set by the gateway for this tenant; do not send it", "cache_salt"
            )
        if policy.public_prefixes and messages is not None and client_salt is None:
            shared = self._public_prefix(policy, messages)
            if shared:
                return SaltDecision(None, name, public_prefix=shared)
        if name == "none":
            if client_salt is None:
                return SaltDecision(None, name)
            return SaltDecision(self._derive("public", str(client_salt)), name)
        if name == "tenant+client" and client_salt is not None:
            return SaltDecision(self._derive("tenant", tenant, str(client_salt)), name)
        return SaltDecision(self._derive("tenant", tenant), name)

    def _public_prefix(self, policy: TenantPolicy, messages: Sequence[Any]) -> str | None:
        for pname in policy.public_prefixes:
            prefix = self.table.public_prefixes.get(pname) or []
            if len(messages) >= len(prefix) and list(messages[: len(prefix)]) == prefix:
                return pname
        return None


__all__ = ["DEFAULT_TENANT", "POLICIES", "SaltDecision", "Tenancy", "validate_salt"]
