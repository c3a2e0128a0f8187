"""Which chat body each endpoint renders: the one place that knows every converter. The
app hands ``CONVERTERS`` to the gateway's request path, which applies them once the body's
model is known to be served (the layers below never import router/api/)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.api import anthropic, responses
from router.intake.routed_request import Endpoint

CONVERTERS: Mapping[Endpoint, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "messages": anthropic.to_chat,
    "responses": responses.to_chat,
}


def to_chat(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-completions body vLLM renders for ``body``; ``None`` for completions."""
    if endpoint == "chat":
        return body
    convert = CONVERTERS.get(endpoint)  # type: ignore[call-overload]
    return convert(body) if convert is not None else None
