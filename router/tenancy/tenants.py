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
import time
from collections.abc import Mapping, Sequence
from typing import Any

from router.config import Config, ConfigError
from router.core.errors import APIError, bad_request
from router.core.record import record
from router.core.salt import validate_cache_salt
from router.tenancy.table import (
    BAND_PRIORITY,
    DEFAULT_TENANT,
    ENGINE_FIELDS,
    POLICIES,
    SaltSecret,
    TenantPolicy,
    default_salt_policy,
    key_digest,
    load_table,
)

log = logging.getLogger("prefix_router.tenancy")


@record
class SaltDecision:
    salt: str | None
    policy: str
    public_prefix: str | None = None


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
