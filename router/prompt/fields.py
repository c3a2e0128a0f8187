"""Request values as vLLM's pydantic request models read them (lax bools and token ids),
plain-JSON copies for the template, and the errors every stage of the renderer raises."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from router.core.errors import APIError, bad_request

# Prompt token ids: an ``array('I')`` from the segment cache, a list elsewhere.
TokenIds = Sequence[int]


def error(message: str, param: str | None = None) -> APIError:
    return bad_request(message, param)


def prompt_too_long(max_prompt_chars: int, n: int | None = None) -> APIError:
    """The ``token_budget`` guard's 400 (``n``: the prompt's length, when known)."""
    got = f" ({n} characters)" if n is not None else ""
    return APIError(
        400,
        f"the prompt is too long{got}: at most {max_prompt_chars} characters are accepted",
        param="messages",
        code="prompt_too_long",
    )


def plain(value: Any) -> Any:
    """A deep copy made of plain JSON types (what transformers' ``_plain_template_data`` hands
    the template), so rendering never touches the caller's body."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def as_token_id(value: Any) -> int | None:
    """An int as pydantic's lax mode accepts it for ``list[int]`` (bool, integral float)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool | None:
    """A bool as pydantic's lax mode reads one (vLLM's request models): True/False, 0/1,
    "true"/"yes"/"on"/"1"/... (case-insensitive); None when it is not a valid boolean."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE_STRINGS:
            return True
        if lowered in _FALSE_STRINGS:
            return False
    return None


def bool_field(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A required-bool request field (absent -> default; null or not a boolean -> 400)."""
    if key not in body:
        return default
    value = lax_bool(body[key])
    if value is None:
        raise error(f"'{key}' must be a boolean", key)
    return value


def check_mm_kwargs(body: Mapping[str, Any], trusted: bool) -> None:
    """Per-request multimodal kwargs are refused unless the replicas trust them."""
    if trusted:
        return
    for key in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(key):
            raise error(
                f"Per-request {key} are disabled by default (vLLM: start the server with "
                "--trust-request-mm-kwargs)",
                key,
            )


def as_list(ids: TokenIds) -> list[int]:
    if isinstance(ids, list):
        return ids
    return ids.tolist() if isinstance(ids, array) else list(ids)


def text_size(value: Any, limit: int) -> int:
    """Characters of text in a JSON value, counting up to about ``limit``."""
    total = 0
    stack = [value]
    while stack and total < limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total
