"""The one description of a request that every stage after parsing reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from router.core.record import record

if TYPE_CHECKING:
    from router.models import ModelEntry

# "messages" (Anthropic) and "responses" (OpenAI Responses) are rendered as chat.
Endpoint = Literal["chat", "completions", "messages", "responses"]


@dataclass(eq=False)
class Tail:
    """The rest of a lazily prepared prompt, being tokenized in a worker thread
    (router/routing/lazy_tail.py says when a decision may use the head alone)."""

    begin: Callable[[], asyncio.Future[Sequence[int]]]  # starts tokenizing the rest
    head_blocks: int  # block hashes the head has
    hashes_final: bool  # the head already has every hash there will be (max_hashed_blocks)
    # The full ids computed in place, when the rest is small enough for the event loop
    # (Renderer.loop_encode_chars): once the request is sent, no thread hand-off.
    finish_inline: Callable[[], Sequence[int]] | None = None
    full: RoutedRequest | None = None  # the request with every id and hash, once known
    taken_back: set[str] = field(default_factory=set)  # replicas a placement was forgotten on
    # Called once ``full`` is known: the exchange that owns the request (its one hook).
    on_full: Callable[[RoutedRequest], None] | None = None
    _ids: asyncio.Future[Sequence[int]] | None = None

    def ids(self) -> asyncio.Future[Sequence[int]]:
        """The full prompt's ids, tokenized in a worker thread from the first call on: the
        gateway calls it once the request is on its way (or when a decision needs them), so
        the thread does not contend for the GIL with the request's own critical path."""
        if self._ids is None:
            self._ids = self.begin()
        return self._ids

    @property
    def started(self) -> bool:
        """Whether the worker thread was given the rest already."""
        return self._ids is not None

    def decides(self, matches: Mapping[str, int]) -> bool:
        """Whether the head's hashes decide exactly: the longest match among the candidates
        stops short of the head's last block (so the first block past it is one nobody
        holds), or the head has every hash already."""
        if self.hashes_final:
            return True
        return self.head_blocks > 0 and max(matches.values(), default=0) < self.head_blocks


@record
class RoutedRequest:
    """An OpenAI request after parsing, tenancy, rendering and hashing (read-only).

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
    max_tokens: int | None = None  # per sequence (router/intake/costs.py ``output_limit``)
    # Prompt tokens of a completions batch's other prompts (all are tokenized; the request
    # routes on its first): priced with the rest, never routed on.
    batch_tokens: int = 0
    sequences: int = 1  # sequences generated: ``n`` per prompt, every prompt of a batch
    # Prompt tokens not in token_ids yet: a lazy head's estimate of its untokenized rest
    # (router/routing/lazy_tail.py); 0 once the prompt is fully tokenized.
    tail_tokens: int = 0
    # The bytes to forward: the client's, with any top-level keys ``body`` changed appended
    # (router/intake/parse.py ``forwarded_bytes``); None when ``body`` must be serialised.
    raw: bytes | None = None
    # A lazy head's rest, still being tokenized (None: ``token_ids`` is the whole prompt).
    tail: Tail | None = None
    # The replica holding state the request names (a Responses ``previous_response_id``):
    # routed there while it serves the model.
    pinned_replica: str | None = None
    # The model's registry entry (router/models/): renderer, block size, replicas, drift.
    model_entry: ModelEntry | None = None
    # A LoRA adapter to load on the chosen replica first (``RequestPath.decide`` sets it per
    # decision: replica, adapter, path; empty when none is needed).
    adapter_load: dict[str, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.tail_tokens

    @property
    def all_prompt_tokens(self) -> int:
        """Prompt tokens the replica computes: the routed prompt and a batch's others."""
        return self.num_tokens + self.batch_tokens

    def forwarded_body(self) -> bytes:
        """The bytes sent to the replica."""
        return self.raw if self.raw is not None else json.dumps(self.body).encode()
