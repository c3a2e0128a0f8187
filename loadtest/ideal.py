"""The ideal hit rate: what one unlimited prefix cache would reuse on the same token sequences.

vLLM's rules (vllm/v1/core/kv_cache_manager.py, kv_cache_utils.py; docs/load-testing.md):

- only full blocks are cached and looked up; a partial last block is always recomputed;
- a hit is the longest run of cached blocks from block 0 (chained hashes: the first miss ends
  it, ``break`` not ``continue``);
- the hit is capped at ``num_tokens - 1`` (the last prompt token is always computed), so a
  prompt of exactly k full blocks can hit at most k - 1 of them;
- ``queries`` counts every prompt token of every request looked up, ``hits`` the tokens served
  from cache, so hit rate = hits / queries in tokens, as ``vllm:prefix_cache_hits_total /
  vllm:prefix_cache_queries_total``;
- generated tokens are cached too (vLLM hashes ``all_token_ids``): when a request finishes,
  the full blocks of prompt + output are in the cache, minus the last sampled token, whose KV
  is never computed -- ``(P + O - 1) // block_size`` blocks.

Requests are replayed as events: at its send time a request is looked up and its prompt's full
blocks are inserted (they exist once prefill runs); at its completion time its output blocks
are inserted. Nothing is evicted: the ideal is the ceiling a fleet with one shared, unlimited
cache could reach on this arrival order, so measured / ideal isolates routing and eviction
losses from prompt-construction losses (a prompt that breaks its own prefix is low here too).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.core.blocks import block_hashes, cacheable_blocks


@dataclass
class IdealRequest:
    """One request as the ideal cache sees it. ``t_end`` / ``output_ids`` are None when the
    completion is unknown (then only the prompt's blocks are inserted)."""

    t_send: float
    prompt_ids: Sequence[int]
    t_end: float | None = None
    output_ids: Sequence[int] | None = None
    cache_salt: str | None = None


@dataclass
class IdealResult:
    hits: int = 0
    queries: int = 0
    requests: int = 0
    per_request_hits: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class IdealCache:
    """An unlimited set of chained block hashes with vLLM's lookup rules."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.blocks: set[int] = set()
        self.result = IdealResult()

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens a request with these prompt ids would get from the cache (no side effects)."""
        limit = cacheable_blocks(len(token_ids), self.block_size)
        hit = 0
        for h in block_hashes(token_ids, self.block_size, cache_salt=cache_salt, max_blocks=limit):
            if h not in self.blocks:
                break
            hit += 1
        return hit * self.block_size

    def insert(
        self, token_ids: Sequence[int], n_blocks: int | None = None, cache_salt: str | None = None
    ) -> None:
        """Cache the first ``n_blocks`` full blocks of ``token_ids`` (default: all of them)."""
        self.blocks.update(
            block_hashes(token_ids, self.block_size, cache_salt=cache_salt, max_blocks=n_blocks)
        )

    def query(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Look a request up (counted in the result), then cache its prompt's full blocks."""
        hit = self.match(token_ids, cache_salt)
        self.result.hits += hit
        self.result.queries += len(token_ids)
        self.result.requests += 1
        self.result.per_request_hits.append(hit)
        self.insert(token_ids, cache_salt=cache_salt)
        return hit

    def finish(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """A request finished: its generated tokens' full blocks are cached too."""
        ids = list(prompt_ids) + list(output_ids)
        self.insert(ids, max(0, len(ids) - 1) // self.block_size, cache_salt)


def ideal_hit_rate(requests: Iterable[IdealRequest], block_size: int) -> IdealResult:
    """Replay ``requests`` through one unlimited cache: lookups in send order, output blocks
    added at completion time (a completion at the same instant as a send comes first)."""
    events: list[tuple[float, int, int, IdealRequest]] = []
    reqs = list(requests)
    for i, r in enumerate(reqs):
        events.append((r.t_send, 1, i, r))
        if r.output_ids is not None and r.t_end is not None:
            # a completion comes before a send at the same instant, never before its own send
            events.append((r.t_end, 0, i, r) if r.t_end > r.t_send else (r.t_send, 2, i, r))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    cache = IdealCache(block_size)
    hits_by_index: dict[int, int] = {}
    for _, kind, i, r in events:
        if kind == 1:
            hits_by_index[i] = cache.query(r.prompt_ids, r.cache_salt)
        else:
            cache.finish(r.prompt_ids, r.output_ids or (), r.cache_salt)
    res = cache.result
    res.per_request_hits = [hits_by_index[i] for i in range(len(reqs))]
    return res
