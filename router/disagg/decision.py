"""Whether a request gets a prefill leg (router/disagg/): decode-first, as llm-d's
``prefix-based-pd-decider`` decides once the decode replica is chosen.

A prefill leg costs a second HTTP round trip, a one-token generation on the prefill
replica, and a KV pull on the decode replica; it saves the decode replica computing the
prompt tokens it does not hold. Below a few hundred uncached tokens the decode replica
computes them in about the time the round trip and the pull take, and its running batch
pays little, so the request is served aggregated on the decode replica itself.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a request was served without a prefill leg: metric label values (a fixed set).
SHORT_PROMPT = "short_prompt"  # fewer prompt tokens than ``min_prompt_tokens``
CACHED_ON_DECODE = "cached_on_decode"  # the decode replica lacks fewer than the threshold
SEVERAL_SEQUENCES = "several_sequences"  # n > 1 or a completions batch (one KV per prompt)
NO_PREFILL_REPLICA = "no_prefill_replica"  # none healthy, or every one failed this request
SKIP_REASONS = (SHORT_PROMPT, CACHED_ON_DECODE, SEVERAL_SEQUENCES, NO_PREFILL_REPLICA)


@dataclass(frozen=True)
class Thresholds:
    """When a prefill leg is worth it (defaults measured with loadtest/bench_pd.py: see
    docs/pd.md)."""

    min_prompt_tokens: int = 256  # shorter prompts never split
    min_uncached_tokens: int = 256  # tokens the chosen decode replica lacks


def skip_reason(
    prompt_tokens: int, decode_cached_tokens: int, sequences: int, thresholds: Thresholds
) -> str | None:
    """None when the request gets a prefill leg, else why not (one of ``SKIP_REASONS``).
    ``decode_cached_tokens``: prompt tokens the chosen decode replica holds (index match)."""
    if sequences > 1:
        return SEVERAL_SEQUENCES
    if prompt_tokens < thresholds.min_prompt_tokens:
        return SHORT_PROMPT
    if prompt_tokens - decode_cached_tokens < thresholds.min_uncached_tokens:
        return CACHED_ON_DECODE
    return None
