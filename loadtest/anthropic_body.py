"""An OpenAI chat conversation as the Anthropic Messages body a client such as Claude Code
sends for it: the system prompt at the top level, tool calls as ``tool_use`` blocks, tool
results as ``tool_result`` blocks in the next user message (with any new instruction beside
them), tools with an ``input_schema``. The agentic workload keeps one history per session and
sends it through either API."""

from __future__ import annotations

import json
from typing import Any


def _tool(defn: dict[str, Any]) -> dict[str, Any]:
    fn = defn["function"]
    return {
        "name": fn["name"],
        "description": fn.get("description", ""),
        "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
    }


def _assistant(m: dict[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls") or []
    if not calls:
        return {"role": "assistant", "content": m.get("content") or ""}
    blocks: list[dict[str, Any]] = []
    if m.get("content"):  # an empty text block is refused by the Messages API
        blocks.append({"type": "text", "text": m["content"]})
    for call in calls:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": fn["name"],
                "input": json.loads(fn["arguments"] or "{}"),
            }
        )
    return {"role": "assistant", "content": blocks}


def messages_body(
    model: str, messages: list[dict[str, Any]], max_tokens: int, tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """The Messages body for an OpenAI-shaped conversation ``messages`` (system first)."""
    system = ""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "system":
            system = m["content"]
            continue
        if role == "assistant":
            out.append(_assistant(m))
            continue
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": m["tool_call_id"],
                "content": m["content"],
            }
        else:
            block = {"type": "text", "text": m["content"]}
        if out and out[-1]["role"] == "user":  # one user turn: results, then the instruction
            out[-1]["content"].append(block)
        else:
            out.append({"role": "user", "content": [block]})
    body: dict[str, Any] = {
        "model": model,
        "messages": out,
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if system:
        body["system"] = system
    if tools:
        body["tools"] = [_tool(t) for t in tools]
    return body
