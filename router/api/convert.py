"""Which chat body each endpoint renders: the one place that knows every converter."""

from __future__ import annotations

from typing import Any

from router.api import anthropic, responses


def to_chat(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-completions body vLLM renders for ``body``; ``None`` for completions."""
    if endpoint == "chat":
        return body
    if endpoint == "messages":
        return anthropic.to_chat(body)
    if endpoint == "responses":
        return responses.to_chat(body)
    return None
