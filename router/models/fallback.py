"""Routing a model whose tokenizer the gateway does not have: a text prefix instead of tokens.

The request is flattened to the text its prompt is made of, in order (tools, then each
message's role and text; a completions prompt as given), and cut into pieces of
``CHARS_PER_TOKEN`` characters; each piece becomes one pseudo token id. Two requests whose
texts share a prefix share leading pseudo blocks, so a conversation's turns and a shared system
prompt still find the replica that holds them, with the model's own block size and chain
hashing. It approximates (a piece is not a token; a block boundary is not the replica's), so
predictions are labelled ``text_prefix`` in explain and metrics and the drift watch ignores
them. Completions prompts given as token ids are the replica's tokens: used as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

CHARS_PER_TOKEN = 4  # about what BPE tokenizers average on English text and code
_SEP = "\x1e"  # between messages: a role change is never mistaken for text


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(p.get("text") if isinstance(p, Mapping) else p) for p in content)
    return json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)


def chat_text(chat: Mapping[str, Any]) -> str:
    """The text of a chat body, in the order a template lays it out."""
    parts: list[str] = []
    tools = chat.get("tools")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, ensure_ascii=False, default=str))
    for m in chat.get("messages") or []:
        if not isinstance(m, Mapping):
            continue
        parts.append(f"{m.get('role')}:{_text(m.get('content'))}")
        if m.get("tool_calls"):
            parts.append(
                json.dumps(m["tool_calls"], sort_keys=True, ensure_ascii=False, default=str)
            )
    return _SEP.join(parts)


def batch_rest(body: Mapping[str, Any]) -> int:
    """Pseudo tokens of a completions batch's prompts after its first (priced, not routed)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or not isinstance(prompt[0], (str, list)):
        return 0
    return sum(
        len(p) if isinstance(p, list) else -(-len(_text(p)) // CHARS_PER_TOKEN) for p in prompt[1:]
    )


def pseudo_ids(text: str) -> list[int]:
    """One id per ``CHARS_PER_TOKEN`` characters (a uint32: the block hasher packs them so)."""
    digest = xxhash.xxh32_intdigest
    step = CHARS_PER_TOKEN
    return [
        digest(text[i : i + step].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), step)
    ]


def prompt_ids(chat: Mapping[str, Any] | None, body: Mapping[str, Any]) -> Sequence[int]:
    """The pseudo token ids of a request: ``chat`` (the chat body every API but completions
    renders) or a completions ``body`` (its first prompt)."""
    if chat is not None:
        return pseudo_ids(chat_text(chat))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return [t for t in prompt if isinstance(t, int) and 0 <= t < 2**32]
        prompt = first
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int) and 0 <= t < 2**32]
    return pseudo_ids(prompt if isinstance(prompt, str) else _text(prompt))
