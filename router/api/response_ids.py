"""Which replica holds each stored response, and which tenant it belongs to, so a
``previous_response_id`` follow-up (or a ``GET``, ``DELETE`` or ``cancel`` of the response)
reaches the one replica whose store has it, and only for the tenant that created it (vLLM keeps
responses in the process that made them, and its store is not tenant-aware).

Learned from the answers: a Responses body's ``id``, or the ``response.created`` event at the
start of a stream. In memory, least recently used first out; in fleet mode also in Redis
(one key per response with a TTL), so a follow-up sent to another gateway finds it too.

A lookup by another tenant does the same work as a lookup of an unknown id (memory, then
Redis), and its caller answers both alike: whether an id exists is not for other tenants
to learn, neither from the answer nor from its timing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("prefix_router")

# vLLM's ids are ``resp_<hex>``; the first ``"id"`` in a body or a response.created event is
# the response's own (it is the object's first field).
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,120})"')
DEFAULT_CAPACITY = 100_000
REDIS_TTL_S = 24 * 3600


def response_id_in(head: bytes) -> str | None:
    m = _ID.search(head)
    return m.group(1).decode() if m else None


def new_response_id() -> str:
    """An id as vLLM makes them (``resp_`` and 32 hex digits), from the OS's randomness."""
    return "resp_" + os.urandom(16).hex()


def _decode(value: Any) -> tuple[str | None, str] | None:
    """A Redis value: ``[tenant, replica]``, or a bare replica URL as gateways before tenant
    ownership stored it (owner unknown)."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    if not text.startswith("["):
        return None, text
    try:
        tenant, replica = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(replica, str) or not (tenant is None or isinstance(tenant, str)):
        return None
    return tenant, replica


class ResponseReplicas:
    """response id -> (tenant, replica URL), bounded; shared through Redis when given a
    client. ``enforce``: a tenant finds only its own responses (auth on); off, any id is
    found by anyone, as with a single tenant."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        redis: Callable[[], Any] = lambda: None,
        namespace: str = "",
        enforce: bool = False,
    ) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._redis = redis  # the client once the gateway has started in fleet mode, or None
        self.namespace = namespace
        self.enforce = enforce

    @property
    def redis(self) -> Any:
        return self._redis()

    def _key(self, response_id: str) -> str:
        return f"{self.namespace}:resp:{response_id}"

    def _mine(self, owner: str | None, tenant: str) -> bool:
        return not self.enforce or owner == tenant

    def remember(self, response_id: str, replica: str, tenant: str) -> bool:
        """In memory, at once: a follow-up may arrive right after the answer. An id another
        tenant holds is never taken over (False)."""
        held = self._map.get(response_id)
        if held is not None and not self._mine(held[0], tenant):
            return False
        self._map[response_id] = (tenant, replica)
        self._map.move_to_end(response_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
        return True

    def forget(self, response_id: str) -> None:
        self._map.pop(response_id, None)

    async def share(self, response_id: str, replica: str, tenant: str) -> None:
        """In Redis, for the other gateways of the fleet. With ownership enforced, an id is
        written only if no gateway wrote it before (first owner wins)."""
        client = self.redis
        if client is not None:
            value = json.dumps([tenant, replica])
            try:
                await client.set(self._key(response_id), value, ex=REDIS_TTL_S, nx=self.enforce)
            except Exception as e:  # Redis down: this gateway still routes its own follow-ups
                log.debug("storing a response id in Redis failed: %r", e)

    async def unshare(self, response_id: str) -> None:
        client = self.redis
        if client is not None:
            try:
                await client.delete(self._key(response_id))
            except Exception as e:
                log.debug("removing a response id from Redis failed: %r", e)

    async def lookup(self, response_id: str, tenant: str) -> str | None:
        """The replica holding ``response_id`` if ``tenant`` may reach it, else None: unknown
        and another tenant's look alike, and cost alike (another tenant's entry in memory
        falls through to Redis, as a miss does)."""
        held = self._map.get(response_id)
        if held is not None and self._mine(held[0], tenant):
            self._map.move_to_end(response_id)
            return held[1]
        client = self.redis
        if client is None:
            return None
        try:
            value = await client.get(self._key(response_id))
        except Exception as e:
            log.debug("looking up a response id in Redis failed: %r", e)
            return None
        found = _decode(value) if value is not None else None
        if found is None or not self._mine(found[0], tenant):
            return None
        return found[1]

    def __len__(self) -> int:
        return len(self._map)
