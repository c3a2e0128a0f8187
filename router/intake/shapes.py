"""Bounded shapes for request bodies, checked once, up front, before any recursive work.

Everything after parsing (normalising, the salt policy, rendering) walks the body recursively
and costs CPU in proportion to its size. ``check_body`` is one iterative pass over the parsed
JSON that refuses, with a 400 naming the field, what no real client sends: nesting deeper
than ``max_depth`` inside any field, more than ``max_nodes`` values, strings longer than
``max_string_chars``, too many messages / content parts / tools / template kwargs, strings
(keys too) holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``: not encodable as UTF-8),
and message text that cannot fit the rendered-prompt cap whatever the template adds.

The defaults are generous: JSON schemas in tools nest < 20 levels, long agent sessions run to
a few thousand messages, OpenAI caps tools at 128, and a 4M-character prompt is already
over any context of 1M tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from router.core.errors import APIError
from router.intake.costs import output_limit

_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")

# A field path as a linked list (parent, segment): O(1) per value walked; turned into
# ``messages[3].content[0].text`` only when something is refused.
_Path = tuple[Any, ...]


class _LimitsConfig(Protocol):
    max_json_depth: int
    max_json_nodes: int
    max_string_chars: int
    max_messages: int
    max_content_parts: int
    max_tools: int
    max_template_kwargs: int
    max_prompt_chars: int


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_depth: int = 64
    max_nodes: int = 1_000_000
    max_string_chars: int = 8 * 1024 * 1024  # a base64 image URL of ~6 MB still fits
    max_messages: int = 20_000
    max_content_parts: int = 1_024
    max_tools: int = 512
    max_template_kwargs: int = 256
    max_prompt_chars: int = 4_000_000  # Config.max_prompt_chars: the rendered-prompt cap

    @classmethod
    def from_config(cls, config: _LimitsConfig) -> BodyLimits:
        return cls(
            max_depth=config.max_json_depth,
            max_nodes=config.max_json_nodes,
            max_string_chars=config.max_string_chars,
            max_messages=config.max_messages,
            max_content_parts=config.max_content_parts,
            max_tools=config.max_tools,
            max_template_kwargs=config.max_template_kwargs,
            max_prompt_chars=config.max_prompt_chars,
        )


DEFAULT_LIMITS = BodyLimits()


def field_path(path: _Path | None) -> str:
    parts: list[str] = []
    while path:
        path, seg = path
        if isinstance(seg, int):
            parts.append(f"[{seg}]")
        elif _PLAIN_KEY.fullmatch(seg):
            parts.append(f".{seg}")
        else:  # JSON-escaped (a lone surrogate becomes \ud800), and cut short
            parts.append("[" + ascii(seg[:64]).replace("'", '"') + "]")
    return "".join(reversed(parts)).lstrip(".")


def _refuse(message: str, path: _Path | None, code: str) -> APIError:
    where = field_path(path)
    shown = where if len(where) <= 120 else where[:60] + "..." + where[-40:]
    return APIError(400, f"{shown or 'the body'}: {message}", param=where or None, code=code)


def _check_string(s: str, path: _Path, limits: BodyLimits) -> None:
    if len(s) > limits.max_string_chars:
        raise _refuse(
            f"string of {len(s)} characters; at most {limits.max_string_chars} are accepted",
            path,
            "string_too_long",
        )
    if not s.isascii() and _SURROGATE.search(s):
        raise _refuse(
            "contains a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode text",
            path,
            "invalid_unicode",
        )


def _at_most(value: Any, n: int, what: str, path: _Path) -> None:
    if isinstance(value, (list, dict)) and len(value) > n:
        raise _refuse(f"{len(value)} {what}; at most {n} are accepted", path, "too_many_items")


def _check_counts(body: dict[str, Any], limits: BodyLimits) -> None:
    """The per-field counts, O(1) each: a 100,000-message body is refused before the walk."""
    _at_most(body.get("messages"), limits.max_messages, "messages", ((), "messages"))
    _at_most(body.get("tools"), limits.max_tools, "tools", ((), "tools"))
    _at_most(
        body.get("chat_template_kwargs"),
        limits.max_template_kwargs,
        "keys",
        ((), "chat_template_kwargs"),
    )
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, tools = limits.max_content_parts, limits.max_tools
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                # The paths are made only for a message that has a list or object to count.
                content, mtools = m.get("content"), m.get("tools")
                if isinstance(content, (list, dict)) or isinstance(mtools, (list, dict)):
                    mpath = (((), "messages"), i)
                    _at_most(content, parts, "content parts", (mpath, "content"))
                    _at_most(mtools, tools, "tools", (mpath, "tools"))


def _message_text_chars(body: dict[str, Any]) -> int:
    """Characters of message content: text every chat template renders (reasoning and other
    fields may be dropped), so a lower bound on the rendered prompt's length."""
    n = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                n += len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        n += len(text)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n = max(n, len(prompt))
    return n


_WIDE = float(2**63)


def check_body(body: dict[str, Any], limits: BodyLimits = DEFAULT_LIMITS) -> bool:
    """Raise a 400 (OpenAI's shape, ``param`` naming the field) for a body outside
    ``limits``. Iterative: its own cost is bounded by ``max_nodes``, whatever the nesting.
    Returns whether the body holds a whole float of 2**63 or more in magnitude (what orjson
    makes of an integer too wide for 64 bits: ``parse_body`` then reads it with the stdlib's
    parser), found on the same walk."""
    _check_counts(body, limits)
    max_chars = limits.max_string_chars
    nodes = 0
    wide = False
    stack: list[tuple[Any, int, _Path]] = [(body, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth >= limits.max_depth:
            raise _refuse(
                f"nested more than {limits.max_depth} levels deep", path, "nested_too_deeply"
            )
        nodes += len(value)
        if nodes > limits.max_nodes:
            raise _refuse(
                f"the body holds more than {limits.max_nodes} JSON values", None, "body_too_complex"
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        # _check_string only where it may refuse: a short ASCII string passes.
        for k, v in items:
            if type(k) is str and (len(k) > max_chars or not k.isascii()):
                _check_string(k, (path, k), limits)
            if type(v) is str:
                if len(v) > max_chars or not v.isascii():
                    _check_string(v, (path, k), limits)
            elif isinstance(v, (dict, list)):
                if v:
                    stack.append((v, depth + 1, (path, k)))
            elif type(v) is float and (v >= _WIDE or v <= -_WIDE) and v.is_integer():
                wide = True
    chars = _message_text_chars(body)
    if chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"the prompt is too long: its messages alone hold {chars} characters, at most "
            f"{limits.max_prompt_chars} are accepted",
            param="messages" if "messages" in body else "prompt",
            code="prompt_too_long",
        )
    return wide


def check_fits(body: dict[str, Any], max_model_len: Any, max_chars_per_token: int) -> None:
    """Refuse, before rendering, a request that cannot fit the model's context: a token
    holds at most ``max_chars_per_token`` characters (its longest vocabulary string), so
    message text of ``c`` characters is at least ``c / max_chars_per_token`` tokens; vLLM
    refuses prompt + ``max_tokens`` beyond ``max_model_len`` with this same 400."""
    if type(max_model_len) is not int or max_model_len < 1 or max_chars_per_token < 1:
        return  # the replicas did not say (max_model_len comes from their /v1/models cards)
    prompt_tokens = -(-_message_text_chars(body) // max_chars_per_token)
    out = output_limit(body) or 0
    if prompt_tokens + out > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested at least {prompt_tokens + out} tokens ({prompt_tokens} or more in the "
            f"messages, {out} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
