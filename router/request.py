"""The one description of a request that every stage after parsing reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# "messages" (Anthropic) and "responses" (OpenAI Responses) are rendered as chat.
Endpoint = Literal["chat", "completions", "messages", "responses"]


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """An OpenAI request after parsing, tenancy, rendering and hashing.

    ``body`` is what is forwarded (the client's fields untouched, plus any ``cache_salt`` the
    tenancy policy set); ``block_hashes`` are the leading full blocks routing looks at, keyed
    with exactly the salt that ``body`` carries."""

    request_id: str
    endpoint: Endpoint
    model: str
    tenant: str
    body: dict[str, Any]
    stream: bool
    token_ids: Sequence[int]  # an array('I') on the gateway's path
    block_size: int
    block_hashes: list[int]
    cache_salt: str | None = None
    lora: str | None = None
    salt_policy: str = "none"
    app_label: str | None = None
    max_tokens: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # Prompt tokens not in token_ids yet: a lazy head's estimate of its untokenized rest
    # (router/lazy_tail.py); 0 once the prompt is fully tokenized.
    tail_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.tail_tokens
