"""vLLM's OpenAI-compatible request fields, read as vLLM reads them (pydantic's lax mode), and
the JSON shapes the simulator answers with. Pure functions: no replica state."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from router.core.errors import bad_request
from router.core.salt import validate_cache_salt

_T = TypeVar("_T")

# Work above this many request bytes (or prompt tokens) is done in a thread so a long prompt
# does not stall the other replicas sharing the event loop.
OFFLOAD_BYTES = 16_384
OFFLOAD_TOKENS = 4_096


async def offload(fn: Callable[[], _T], heavy: bool) -> _T:
    return await asyncio.to_thread(fn) if heavy else fn()


async def read_json(request: web.Request) -> tuple[dict[str, Any], int]:
    """The request's JSON object and its size in bytes; a 400 for anything else."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"Invalid JSON in request body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body, len(raw)


def opt_int(body: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    """An optional integer field, read as pydantic's lax mode reads one (integral floats are
    accepted, bools and strings are not)."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer, got {type(v).__name__}", key)
    if minimum is not None and v < minimum:
        raise bad_request(f"{key} must be at least {minimum}, got {v}.", key)
    return v


def cache_salt(body: dict[str, Any]) -> str | None:
    """The request's ``cache_salt``, checked by the gateway's rule (vLLM's, with vLLM's
    messages), so the simulator and the gateway cannot disagree on what is valid."""
    salt = body.get("cache_salt")
    validate_cache_salt(salt)
    return salt


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def opt_bool(body: dict[str, Any], key: str) -> bool | None:
    """An optional boolean field, pydantic-lax: true/false, 0/1, "true"/"yes"/"on"/..."""
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise bad_request(f"{key} must be a boolean", key)


def stream_options(body: dict[str, Any], force_include_usage: bool = False) -> tuple[bool, bool]:
    """(stream, include_usage); vLLM's --enable-force-include-usage (``force_include_usage``)
    includes it on every stream, as does ``stream_options.include_usage``. (Usage on every
    chunk, vLLM's continuous_usage_stats, comes with the forced flag: ``continuous_usage``.)"""
    stream = bool(opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if opts and not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = force_include_usage or bool(opts and opt_bool(opts, "include_usage"))
    return stream, include_usage


def continuous_usage(body: dict[str, Any], force_include_usage: bool = False) -> bool:
    """Usage on every chunk (vLLM's should_include_usage: forced, or include_usage and
    continuous_usage_stats)."""
    if force_include_usage:
        return True
    opts = body.get("stream_options")
    return bool(
        isinstance(opts, dict)
        and opt_bool(opts, "include_usage")
        and opt_bool(opts, "continuous_usage_stats")
    )


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return (
            isinstance(x, list)
            and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if is_ids(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(is_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    if prompt is None or prompt == [] or prompt == "":
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    raise bad_request(
        "prompt must be a non-empty string, a list of token ids, a list of "
        "strings or a list of lists of token ids",
        "prompt",
    )


def make_usage(
    prompt_tokens: int, completion_tokens: int, cached: int, details: bool, zero: bool = False
) -> dict[str, Any]:
    # vLLM 0.34 attaches prompt_tokens_details whenever --enable-prompt-tokens-details is on
    # (chat_completion/serving.py:_make_prompt_tokens_details: num_cached_tokens is an int, 0
    # on a miss). Older releases attached it only on a hit (`... and num_cached_tokens`);
    # ``zero=False`` reproduces that: `"prompt_tokens_details": null` on a miss.
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": (
            {"cached_tokens": cached} if details and (cached or zero) else None
        ),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=dumps(obj).encode(), status=status, content_type="application/json", headers=headers
    )
