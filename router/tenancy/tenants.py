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
- ``passthrough``   (auth off only; the default then) the client's salt is forwarded as is.

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
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from router.config import Config, ConfigError
from router.core.errors import APIError, bad_request
from router.core.record import record
from router.core.salt import validate_cache_salt
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


@record
class SaltDecision:
    salt: str | None
    policy: str
    public_prefix: str | None = None


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


class Tenancy:
    """Identifies tenants and decides each request's salt. Reloads the keys file when it
    changes, so keys and secrets roll without a restart."""

    def __init__(self, config: Config, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._env = env
        self.default_policy = default_salt_policy(config)
        self._signature = self._file_signature()
        self.table = load_table(config, env)
        self._checked = time.monotonic()

    def _file_signature(self) -> tuple[int, int, int] | None:
        """(mtime ns, size, inode): an in-place rewrite or an atomic rename both change it."""
        if not self.config.auth.api_keys_file:
            return None
        try:
            st = os.stat(self.config.auth.api_keys_file)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def maybe_reload(self, force: bool = False) -> None:
        """At most once a second, reload the keys file if it changed; keep the old table if
        the new file is broken or incomplete (and say so, without quoting it)."""
        now = time.monotonic()
        if not self.config.auth.api_keys_file or (not force and now - self._checked < 1.0):
            return
        self._checked = now
        signature = self._file_signature()
        if signature == self._signature:
            return
        self._signature = signature
        try:
            self.table = load_table(self.config, self._env)
        except ConfigError as e:  # phrased by us: names fields, never keys or secrets
            log.error("keeping the previous tenants: %s", e)
            return
        except Exception as e:  # anything else may quote the file: only its type
            log.error(
                "keeping the previous tenants: %s could not be loaded (%s)",
                self.config.auth.api_keys_file,
                type(e).__name__,
            )
            return
        log.info(
            "reloaded %s: %d tenants, %d keys, %d salt secrets",
            self.config.auth.api_keys_file,
            len(self.table.tenants),
            len(self.table.keys),
            len(self.table.secrets),
        )

    # -- identity -------------------------------------------------------------------------
    def identify(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request; a 401 ``APIError`` when auth is on and fails."""
        self.maybe_reload()
        if not self.config.auth.enabled:
            if self.config.auth.tenant_header:
                name = headers.get(self.config.auth.tenant_header, "").strip()
                if name and len(name) <= 128 and name.isprintable():
                    return name
            return DEFAULT_TENANT
        auth = headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if not auth and "x-api-key" in headers:  # Anthropic's header (its SDK sends it)
            scheme, key = "bearer", headers["x-api-key"]
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401,
                "missing API key: send Authorization: Bearer <key> (or x-api-key: <key>, as "
                "Anthropic clients do)",
                code="invalid_api_key",
            )
        # Only SHA-256 digests are stored, and the presented key is looked up by its digest.
        # The lookup's timing can at most depend on the digest, never on the key's bytes, so
        # it teaches an attacker nothing a preimage search would need (the same argument as
        # comparing digests with hmac.compare_digest). The key is never logged or echoed.
        tenant = self.table.keys.get(key_digest(key.strip()))
        if tenant is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def policy_of(self, tenant: str) -> TenantPolicy:
        return self.table.tenants.get(tenant) or TenantPolicy(tenant, self.default_policy)

    # -- what a tenant may ask for (auth on; with auth off the tenant is the client's word and
    # the operator owns the fleet: engine fields pass through, every model is open) ---------
    def check_fields(self, tenant: str, body: Mapping[str, Any]) -> None:
        """A 400 naming the first engine-control field ``body`` carries that the tenant's
        entry does not allow (``allow_fields``)."""
        if not self.config.auth.enabled:
            return
        allowed = self.policy_of(tenant).allow_fields
        for name in ENGINE_FIELDS:
            if name in body and name not in allowed:
                raise bad_request(
                    f"`{name}` steers the engine and is set by the gateway; this API key may "
                    "not send it",
                    name,
                )

    def may_use(self, tenant: str, *names: str | None) -> bool:
        """Whether any of ``names`` (a model or adapter, the client's name or what it is an
        alias of) is on the tenant's ``models`` allow-list (no list: every model)."""
        if not self.config.auth.enabled:
            return True
        allowed = self.policy_of(tenant).models
        return allowed is None or any(n in allowed for n in names if n)

    def band_priority(self, tenant: str) -> int:
        """vLLM's ``priority`` for the tenant's flow-control band (lower runs first)."""
        return BAND_PRIORITY[self.policy_of(tenant).flow.band]

    # -- salt -----------------------------------------------------------------------------
    def current_secret(self, now: float | None = None) -> SaltSecret | None:
        """The secret in force at wall-clock ``now``: the latest ``not_before`` that has
        passed (every gateway with the same file and a synchronised clock switches at the
        same instant); before the first ``not_before``, the earliest secret."""
        now = time.time() if now is None else now
        for s in self.table.secrets:  # newest first
            if s.not_before <= now:
                return s
        return self.table.secrets[-1] if self.table.secrets else None

    def _derive(self, *parts: str) -> str:
        """``pr<epoch>-`` + 48 hex digits of HMAC-SHA256(secret, parts): at most 83 characters
        of ``[A-Za-z0-9._-]``, valid under vLLM's rules. The parts are JSON-encoded, so no
        tenant name or client salt can be chosen to collide with another's."""
        secret = self.current_secret()
        assert secret is not None  # check_table demands one whenever a policy salts
        message = json.dumps(parts, ensure_ascii=False).encode()
        mac = hmac.new(secret.value, message, hashlib.sha256).hexdigest()
        return f"pr{secret.epoch}-{mac[:48]}"

    def salt(
        self, tenant: str, client_salt: object | None, messages: Sequence[Any] | None = None
    ) -> SaltDecision:
        policy = self.policy_of(tenant)
        if client_salt is not None:
            validate_cache_salt(client_salt)  # vLLM's rule, so a bad salt is ours to reject
        name = policy.salt_policy
        if name == "passthrough":
            return SaltDecision(client_salt if isinstance(client_salt, str) else None, name)
        if name == "reject" and client_salt is not None:
            raise bad_request(
                "cache_salt is set by the gateway for this tenant; do not send it", "cache_salt"
            )
        # Under ``tenant`` a client salt is ignored anyway, so it does not opt out of sharing;
        # under ``tenant+client`` / ``none`` it asks for a scope of its own, so it does.
        if (
            policy.public_prefixes
            and messages is not None
            and (client_salt is None or name == "tenant")
        ):
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


__all__ = ["DEFAULT_TENANT", "POLICIES", "SaltDecision", "Tenancy"]
