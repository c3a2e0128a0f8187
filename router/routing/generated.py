"""Generated blocks: what a replica holds after answering, prompt and answer together.

vLLM caches the full blocks of every token a request computed: the prompt's and the ones it
generated, except the last sampled token, which was never fed back (vllm/v1/core/
kv_cache_manager.py caches ``num_computed_tokens``; the last token is sampled, not computed).
A conversation's next turn repeats the answer after the prompt, so without these blocks the
gateway predicts the next turn short of what the replica reports.

The answer's ids are not in the response; the gateway re-tokenizes the answer's text, and uses
it only where that is the generated sequence: the text re-tokenizes to as many tokens as
``usage.completion_tokens`` says were generated (plus the stop token for ``finish_reason``
stop). Streams are relayed as they are; their chunks are read after the stream ended.
Chat only, one choice, plain text (no tool calls, no reasoning): anything else is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.core import blocks
from router.intake.routed_request import RoutedRequest

# Answers up to this size are read on the event loop right after they end (measured: ~0.4 ms
# for a 225-token JSON answer, ~1.1 ms for its 20 KB stream, parse and re-tokenize), so the
# next turn, sent once the client has the answer, finds them; longer ones off the loop.
INLINE_BYTES = 32 * 1024


def answer_text(body: bytes, stream: bool) -> tuple[str, str | None] | None:
    """(content, finish_reason) of a chat answer's only choice, or None."""
    try:
        if not stream:
            data = json.loads(body)
            choices = data.get("choices") if isinstance(data, dict) else None
            if not isinstance(choices, list) or len(choices) != 1:
                return None
            msg = choices[0].get("message") or {}
            if msg.get("tool_calls") or msg.get("reasoning_content") or msg.get("reasoning"):
                return None
            content = msg.get("content")
            return (content, choices[0].get("finish_reason")) if isinstance(content, str) else None
        parts: list[str] = []
        finish: str | None = None
        for event in body.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            chunk: Any = json.loads(event[6:])
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    return None
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    return None
                if delta.get("reasoning"):
                    return None
                if isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                finish = choice.get("finish_reason") or finish
        return "".join(parts), finish
    except (ValueError, AttributeError, TypeError):
        return None


def cached_after(
    prompt: Sequence[int], answer: Sequence[int], finish: str | None, completion: int | None
) -> list[int] | None:
    """The token ids the replica caches after answering, or None where the re-tokenized
    answer is not the generated sequence (its length differs from what was generated)."""
    if completion is None or finish not in ("stop", "length"):
        return None
    # stop on EOS: the stop token was generated after the text and is the last sampled
    # token; otherwise (length, or a stop without a token of its own) the text's last is.
    if finish == "stop" and len(answer) + 1 == completion:
        return [*prompt, *answer]
    if len(answer) == completion and answer:
        return [*prompt, *answer[:-1]]
    return None


def extra_hashes(
    prompt_hashes: Sequence[int], ids: Sequence[int], block_size: int, root: int
) -> list[int]:
    """The hashes of ``ids``' full blocks after the prompt's, chained onto its last (or onto
    ``root`` when the prompt had no full block)."""
    start = len(prompt_hashes)
    rest = ids[start * block_size :]
    parent = prompt_hashes[-1] if prompt_hashes else root
    return blocks.continue_chain(parent, rest, block_size)


def wanted(rr: RoutedRequest) -> bool:
    """Whether to keep ``rr``'s answer: a chat request for a model routed by its tokens (the
    learner drops it unread in precise mode, where KV events report these blocks)."""
    entry = rr.model_entry
    return rr.endpoint == "chat" and entry is not None and entry.renderer is not None


def hashes_after(
    rr: RoutedRequest, status: int, answer: bytes, completion: int | None
) -> list[int]:
    """The hashes of the blocks the replica holds after answering ``rr`` beyond its prompt's
    (empty when unknown: not chat, not one plain choice, not measured equal, a capped chain)."""
    entry = rr.model_entry
    renderer = entry.renderer if entry is not None else None
    if status != 200 or not answer or renderer is None or entry is None:
        return []
    size = rr.block_size
    if rr.tail is not None or len(rr.block_hashes) != len(rr.token_ids) // size:
        return []  # a lazy head or a capped chain: the prompt's blocks are not all known
    got = answer_text(answer, rr.stream)
    if got is None:
        return []
    ids = cached_after(
        rr.token_ids,
        renderer.tokenizer.encode(got[0], add_special_tokens=False),
        got[1],
        completion,
    )
    if ids is None:
        return []
    root = blocks.root_hash(rr.cache_salt, rr.lora, entry.namespace)
    return extra_hashes(rr.block_hashes, ids, size, root)
