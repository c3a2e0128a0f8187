"""Which replica holds each stored response, so a ``previous_response_id`` follow-up reaches
the one replica whose store has it (vLLM keeps responses in the process that made them).

Learned from the answers: a Responses body's ``id``, or the ``response.created`` event at the
start of a stream. In memory, least recently used first out; in fleet mode also in Redis
(one key per response with a TTL), so a follow-up sent to another gateway finds it too.
"""

from __future__ import annotations

import logging
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


class ResponseReplicas:
    """response id -> replica URL, bounded; shared through Redis when given a client."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        redis: Callable[[], Any] = lambda: None,
        namespace: str = "",
    ) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()
        self._redis = redis  # the client once the gateway has started in fleet mode, or None
        self.namespace = namespace

    @property
    def redis(self) -> Any:
        return self._redis()

    def _key(self, response_id: str) -> str:
        return f"{self.namespace}:resp:{response_id}"

    def remember(self, response_id: str, replica: str) -> None:
        """In memory, at once: a follow-up may arrive right after the answer."""
        self._map[response_id] = replica
        self._map.move_to_end(response_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    async def share(self, response_id: str, replica: str) -> None:
        """In Redis, for the other gateways of the fleet."""
        client = self.redis
        if client is not None:
            try:
                await client.set(self._key(response_id), replica, ex=REDIS_TTL_S)
            except Exception as e:  # Redis down: this gateway still routes its own follow-ups
                log.debug("storing response %s in Redis failed: %r", response_id, e)

    async def lookup(self, response_id: str) -> str | None:
        url = self._map.get(response_id)
        if url is not None:
            self._map.move_to_end(response_id)
            return url
        client = self.redis
        if client is None:
            return None
        try:
            value = await client.get(self._key(response_id))
        except Exception as e:
            log.debug("looking up response %s in Redis failed: %r", response_id, e)
            return None
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def __len__(self) -> int:
        return len(self._map)
