"""Anthropic Messages body -> the chat-completions body vLLM renders for it.

As vllm/entrypoints/anthropic/serving.py (``_convert_anthropic_to_openai_request``) does:
the top-level system text (string, or text blocks without Claude Code's billing header)
joined with no separator; text blocks as text parts (one text
block becomes a plain string); ``thinking`` blocks as the message's ``reasoning``;
``tool_use`` as ``tool_calls`` with ``json.dumps(input)`` arguments; a user's
``tool_result`` as a ``tool`` message; inline ``role: system`` messages kept in place;
``thinking: {"type": "disabled"}`` as ``reasoning_effort: "none"``; images as ``image_url`` parts (which the renderer
refuses: the served model is not multimodal). ``cache_control`` is ignored, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from router.core.errors import APIError, bad_request

_BILLING_HEADER = "x-anthropic-billing-header"
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(e: APIError, headers: dict[str, str] | None = None) -> web.Response:
    """``e`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    resp = web.json_response(body, status=e.status, headers={**e.headers, **(headers or {})})
    if e.close_connection:
        resp.force_close()
    return resp


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{j}] must be an object with a string type", where)
    return content


def _system_parts(body: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif system is not None:
        parts += _texts(_blocks(system, "system"))
    return parts


def _inline_system(msg: dict[str, Any], i: int) -> str | None:
    """A ``role: system`` message's text, billing header stripped (kept in place, as vLLM
    does unless the template demands system-first ordering)."""
    content = msg.get("content")
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    return "".join(_texts(_blocks(content, f"messages.{i}.content"))) or None


def _texts(blocks: list[dict[str, Any]]) -> list[str]:
    return [
        b["text"]
        for b in blocks
        if b["type"] == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(_BILLING_HEADER)
    ]


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's tool_result: a ``tool`` message, then its images as a user message."""
    content = block.get("content")
    text, images, refs = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    tool_content: str | list[dict[str, Any]] = text or ""
    if refs:  # one tool message: the references first, then the text
        tool_content = refs + ([{"type": "text", "text": text}] if text else [])
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": tool_content}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        out.append({"role": "user", "content": parts})
    return out


def _message(msg: dict[str, Any], i: int, out: list[dict[str, Any]]) -> None:
    role = msg["role"]
    content = msg.get("content")
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in _blocks(content, f"messages.{i}.content"):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":  # appended before this message, as vLLM does
                out.extend(_tool_result(block))
            else:
                result = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
        # redacted_thinking, tool_reference and unknown blocks: skipped, as vLLM does
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        converted["content"] = parts[0]["text"] if only_text else parts
    if role == "user" and "content" not in converted:
        return  # a user turn of tool results only
    out.append(converted)


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise bad_request("tool_choice must be an object with a type", "tool_choice")
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise bad_request(f"unknown tool_choice type {kind!r}", "tool_choice")
    return mapped


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{j}] must be an object with a string name", "tools")
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: dict[str, Any], *, count_tokens: bool = False) -> dict[str, Any]:
    """The chat-completions body vLLM renders for a Messages (or count_tokens) body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(
                f"messages[{i}] must be an object with role user, assistant or system",
                "messages",
            )
    if not count_tokens:
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise bad_request("max_tokens is required: a positive integer", "max_tokens")
    chat_messages: list[dict[str, Any]] = []
    system = _system_parts(body)
    if system:
        chat_messages.append({"role": "system", "content": "".join(system)})
    for i, m in enumerate(messages):
        if m["role"] == "system":
            text = _inline_system(m, i)
            if text:
                chat_messages.append({"role": "system", "content": text})
        else:
            _message(m, i, chat_messages)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages}
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    if not count_tokens:
        chat["max_tokens"] = body["max_tokens"]
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        chat["reasoning_effort"] = output_config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("disabled", "between_tools"):
        chat["reasoning_effort"] = "none"  # vLLM's default for templates with enable_thinking
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
        chat.setdefault("tool_choice", "auto")
    return chat
