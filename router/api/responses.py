"""OpenAI Responses body -> the chat-completions body vLLM renders for it.

As vllm/entrypoints/openai/responses/utils.py (``construct_input_messages``,
``construct_tool_dicts``, ``should_continue_final_message``) does: ``instructions`` as a
system message; a string ``input`` as one user message; input items in order, where a
``function_call`` joins the preceding assistant message's ``tool_calls``, a ``reasoning`` item
becomes (or fills) an assistant message's ``reasoning``, an assistant ``message`` fills the
preceding assistant message's content if it had none, a ``function_call_output`` is a
``tool`` message, and any other item (user/system/developer messages) is passed as is.
Function tools are flattened Responses tools re-nested under ``function``.

The conversation behind ``previous_response_id`` lives on the replica that answered it; the
gateway sees only the new input, and routes the follow-up to that replica instead
(router/api/response_ids.py).
"""

from __future__ import annotations

from typing import Any

from router.core.errors import bad_request, clip


def _first_text(parts: Any) -> str:
    if isinstance(parts, str):
        return parts
    if isinstance(parts, list) and parts:
        first = parts[0]
        return str(first.get("text", "")) if isinstance(first, dict) else str(first)
    return ""


def _item_message(item: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a chat message, or ``None`` when it was merged into ``prev``."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        name = item.get("name")
        if item.get("namespace"):
            name = f"{item['namespace']}.{name}"
        call = {
            "id": item.get("call_id"),
            "function": {"name": name, "arguments": item.get("arguments")},
            "type": "function",
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise bad_request("Encrypted content is not supported.", "input")
        text = _first_text(item.get("content")) or _first_text(item.get("summary"))
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _first_text(item.get("content"))
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if not isinstance(item.get("role"), str):
        raise bad_request(f"unsupported input item type {clip(repr(kind))}", "input")
    return {k: v for k, v in item.items() if k not in ("type", "id", "status")}


def _continues(items: list[dict[str, Any]]) -> bool:
    """A trailing partial assistant message or reasoning item is continued, not answered."""
    last = items[-1] if items else None
    if last is None or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{j}] must be an object", "tools")
        if tool.get("type") != "function":
            continue  # built-in tools (web search, MCP...) are not rendered as functions
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{j}].name must be a string", "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out or None


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body vLLM renders for a Responses body."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    raw_input = body.get("input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    continues = False
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list) and raw_input:
        for j, item in enumerate(raw_input):
            if not isinstance(item, dict):
                raise bad_request(f"input[{j}] must be an object", "input")
            msg = _item_message(item, messages[-1] if messages else None)
            if msg is not None:
                messages.append(msg)
        continues = _continues(raw_input)
    else:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    if not messages:
        raise bad_request("input has no message to render", "input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if continues:
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise bad_request("max_output_tokens must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = max_tokens
    return chat
