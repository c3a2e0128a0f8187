"""Request bodies: JSON parsing and the checks of the fields routing reads (everything else is
forwarded untouched and judged by the replica)."""

from __future__ import annotations

import json
from typing import Any

from router.errors import bad_request
from router.limits import DEFAULT_LIMITS, BodyLimits, check_body
from router.request import Endpoint


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def parse_body(
    raw: bytes, endpoint: Endpoint, limits: BodyLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """Validate the fields routing reads; everything else is forwarded untouched."""
    body = parse_json_object(raw)
    check_body(body, limits)  # bounded shapes first: what follows recurses
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise bad_request("stream must be a boolean", "stream")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad_request(f"{key} must be a non-negative integer", key)
    if endpoint in ("messages", "responses"):
        return body  # checked by its converter (router/api/)
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("prompt is required", "prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
    return body
