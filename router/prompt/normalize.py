"""Chat body normalisation: what vLLM 0.34.0 hands the chat template for a request body.

Messages (content parts, assistant tool calls, reasoning, developer -> system) are normalised
here; the template parameters (tools, tool_choice, chat_template_kwargs) in ``chat_params``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import router.prompt.chat_params as chat_params
from router.core.salt import validate_cache_salt
from router.prompt.fields import bool_field, check_mm_kwargs, error, plain, prompt_too_long
from router.prompt.jinja import ContentFormat
from router.prompt.template import ChatTemplate

# Content part type -> the key holding its text (chat_message.MM_PARSER_MAP / TEXT_PART_TYPES).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)
_MEDIA_KEYS = _MEDIA_PARTS  # a part carrying one of these keys is media, whatever its type
_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})  # may send "content": null

_BILLING_HEADER = "x-anthropic-billing-header"


def content_parts(
    role: str, content: Any, i: int, fmt: ContentFormat
) -> str | list[dict[str, Any]]:
    """vllm.renderers.chat_utils.parse_chat_message_content(_parts): text parts kept
    (empty ones dropped), joined with "\\n" for string-format templates."""
    if type(content) is str and not (role == "system" and content.startswith(_BILLING_HEADER)):
        # What the parts loop below makes of one text part, without making it: the text
        # (empty or not: one part joined, or none), as one dict part for openai-format
        # templates (a tool's joined to its text). tests/prompt/test_normalize_fast.py.
        if fmt == "openai" and role != "tool":
            return [{"type": "text", "text": content}]
        return content
    param = f"messages.{i}.content"
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise error(f"messages[{i}].content must be a string or a list of content parts", param)
    if role == "system":
        parts = strip_billing_header(parts)
    texts: list[Any] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise error(f"messages[{i}].content[{j}] must be an object", param)
        ptype = part.get("type")
        if ptype is None:
            if any(k in part for k in _MEDIA_KEYS):
                raise error("the served model is not multimodal", param)
            raise error("Missing 'type' field in multimodal part.", param)
        if not isinstance(ptype, str):
            raise error("Invalid 'type' field in multimodal part.", param)
        if ptype in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[ptype])
            if text is None:
                continue  # vLLM skips a text part with no text
            if not isinstance(text, str):
                raise error(
                    f"messages[{i}].content[{j}].{_TEXT_PARTS[ptype]} must be a string", param
                )
            if fmt == "openai":  # a dict part, kept even when its text is empty
                extra = {
                    k: plain(v)
                    for k, v in part.items()
                    if k not in ("type", "text", "refusal", "thinking", "closed")
                }
                texts.append({"type": "text", "text": text, **extra})
            elif text:  # vLLM drops empty strings
                texts.append(text)
        elif ptype == "tool_reference":
            name = part.get("name")
            if name:
                texts.append(
                    {"type": "tool_reference", "name": name} if fmt == "openai" else str(name)
                )
        elif ptype in _MEDIA_PARTS or any(k in part for k in _MEDIA_KEYS):
            raise error(
                "the served model is not multimodal: only text content parts are supported",
                param,
            )
        else:
            raise error(f"Unsupported chat content part type: {ptype!r}.", param)
    if fmt == "openai":
        if role == "tool" and all(isinstance(t, dict) and t.get("type") == "text" for t in texts):
            return "\n".join(t["text"] for t in texts)
        return texts
    return "\n".join(texts)


def strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop Claude Code's ``x-anthropic-billing-header`` first line from system text parts
    (its value changes every request and would break the prefix)."""
    out: list[Any] = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append({**part, "text": rest})
    return out


def tool_calls(calls: Any, i: int) -> list[dict[str, Any]] | None:
    """Assistant tool_calls as the template gets them: arguments parsed to a dict
    (invalid JSON or a non-object -> {})."""
    param = f"messages.{i}.tool_calls"
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise error(f"messages[{i}].tool_calls must be a list", param)
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise error("assistant tool_calls entries must be objects.", param)
        fn = call.get("function")
        if call.get("type") != "function" or not isinstance(fn, dict):
            raise error(
                "chat completions only support assistant tool_calls of type 'function'.", param
            )
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise error(
                f"messages[{i}].tool_calls[{j}].function needs a string name and string arguments",
                param,
            )
        if not isinstance(call.get("id"), str):
            raise error(f"messages[{i}].tool_calls[{j}].id is required and must be a string", param)
        args: Any = fn["arguments"]
        if args:
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                args = {}
            if not isinstance(args, dict):
                args = {}
        else:
            args = {}
        item = {k: plain(v) for k, v in call.items() if k != "function"}
        item["function"] = {**{k: plain(v) for k, v in fn.items()}, "arguments": args}
        out.append(item)
    return out


def conversation(messages: Any, fmt: ContentFormat, max_prompt_chars: int) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise error("'messages' must be a list of messages", "messages")
    conv: list[dict[str, Any]] = []
    budget = max_prompt_chars
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise error(f"messages[{i}] must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str):
            raise error(
                f"messages[{i}].role is required and must be a string", f"messages.{i}.role"
            )
        content = msg.get("content")
        if content is None and "content" in msg and role not in _NULL_CONTENT_ROLES:
            # absent content renders as "", but an explicit null is rejected
            raise error(
                f"messages[{i}].content must be a string or a list of content parts, "
                f"not null, for role {role!r}",
                f"messages.{i}.content",
            )
        name = msg.get("name")
        if "name" in msg and not isinstance(name, str):
            raise error(f"messages[{i}].name must be a string", f"messages.{i}.name")
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")  # vLLM renames it to "reasoning"
        if role == "assistant" and reasoning is not None and not isinstance(reasoning, str):
            raise error(f"messages[{i}].reasoning must be a string", f"messages.{i}.reasoning")
        out: dict[str, Any] = {
            "role": role,
            "content": content_parts(role, content, i, fmt),
        }
        if isinstance(out["content"], str):
            budget -= len(out["content"])
        if role == "assistant":
            calls = tool_calls(msg.get("tool_calls"), i)
            if calls:  # an empty list is dropped
                out["tool_calls"] = calls
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
                budget -= len(reasoning)
        elif role == "tool" and "tool_call_id" in msg:
            tcid = msg["tool_call_id"]
            if tcid is not None and not isinstance(tcid, str):
                raise error(
                    f"messages[{i}].tool_call_id must be a string", f"messages.{i}.tool_call_id"
                )
            out["tool_call_id"] = tcid
        if isinstance(name, str):
            out["name"] = name
        task = msg.get("task")
        if isinstance(task, str):
            out["task"] = task
        if role == "developer":
            out["tools"] = plain(msg.get("tools"))
        if budget < 0:
            raise prompt_too_long(max_prompt_chars)
        conv.append(out)
    return conv


def developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vllm.renderers.hf: developer -> system, then every system message merged into one
    at position 0 (joined with a blank line) if any is not first or there are several."""
    conv = [
        {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
        if m["role"] == "developer"
        else m
        for m in conv
    ]
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            if i > 0 or contents:
                merge = True
            content = m.get("content", "")
            if isinstance(content, list):
                content = "\n".join(
                    p["text"] if isinstance(p, dict) else p
                    for p in content
                    if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
                )
            if content:
                contents.append(content)
        else:
            rest.append(m)
    if not merge:
        return conv
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


# The fields chat_params.chat_kwargs reads besides the flags (None is as absent).
_KWARGS_FIELDS = ("chat_template_kwargs", "chat_template", "reasoning_effort", "documents")


class ChatNormalizer:
    """Turns a chat request body into the inputs vLLM hands the chat template."""

    def __init__(
        self,
        template: ChatTemplate,
        *,
        max_prompt_chars: int,
        default_chat_template_kwargs: Mapping[str, Any],
        special_tokens_map: Mapping[str, Any],
        trust_request_mm_kwargs: bool,
    ) -> None:
        self.template = template
        self.max_prompt_chars = max_prompt_chars
        self.default_chat_template_kwargs = default_chat_template_kwargs
        self.special_tokens_map = special_tokens_map
        self.trust_request_mm_kwargs = trust_request_mm_kwargs
        # (add_generation_prompt, continue_final_message) -> (chat kwargs, the template
        # variables they were filtered for, template kwargs, documents) of a body that sets
        # none of _KWARGS_FIELDS: the server's defaults and the flags, the same for every
        # such request (chat_params.chat_kwargs reads nothing else of a body).
        self._plain: dict[
            tuple[bool, bool], tuple[dict[str, Any], frozenset[str], dict[str, Any], Any]
        ] = {}

    def normalize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs vLLM hands the chat template for this body: ``{"conversation",
        "tools", "template_kwargs", "add_generation_prompt", "continue_final_message",
        "add_special_tokens"}``. Raises APIError(400) on what vLLM rejects."""
        if not isinstance(body, Mapping):
            raise error("the request body must be a JSON object")
        validate_cache_salt(body.get("cache_salt"))
        agp = bool_field(body, "add_generation_prompt", True)
        cfm = bool_field(body, "continue_final_message", False)
        if agp and cfm:
            raise error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        add_special = bool_field(body, "add_special_tokens", False)
        check_mm_kwargs(body, self.trust_request_mm_kwargs)
        # A body that sets none of the fields chat_kwargs reads (but the flags) gets the
        # server's defaults and the flags: kept per flags, and per template below.
        plain_kwargs = (  # _KWARGS_FIELDS, spelled out: no generator per request
            body.get("chat_template_kwargs") is None
            and body.get("chat_template") is None
            and body.get("reasoning_effort") is None
            and body.get("documents") is None
        )
        found = self._plain.get((agp, cfm)) if plain_kwargs else None
        kwargs = (
            found[0]
            if found is not None
            else chat_params.chat_kwargs(body, agp, cfm, self.default_chat_template_kwargs)
        )
        chat_params.check_tool_choice(body)
        tools = chat_params.tools(body)
        if "tools" in kwargs:  # a chat_template_kwargs "tools" replaces the request's
            tools = plain(kwargs["tools"])
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise error("Tools should be a list of JSON schemas", "chat_template_kwargs")
        compiled = self.template.resolve(tools)
        conv = conversation(body.get("messages"), compiled.content_format, self.max_prompt_chars)
        if not conv:
            raise error(
                "Cannot apply chat template to an empty conversation. Provide at "
                "least one message.",
                "messages",
            )
        if not compiled.developer:
            for m in conv:
                if m["role"] == "developer":
                    conv = developer_to_system(conv)
                    break
        if found is None:
            template_kwargs, docs = chat_params.template_kwargs(
                kwargs, compiled.variables, self.special_tokens_map
            )
            if plain_kwargs:  # the same for every such request
                if len(self._plain) >= 16:
                    self._plain.clear()
                kept = (kwargs, compiled.variables, dict(template_kwargs), docs)
                self._plain[(agp, cfm)] = kept
        elif found[1] is compiled.variables:
            template_kwargs, docs = dict(found[2]), found[3]  # a copy: the caller's to keep
        else:  # another template (tools chose it): the defaults' kwargs, filtered for it
            template_kwargs, docs = chat_params.template_kwargs(
                kwargs, compiled.variables, self.special_tokens_map
            )
        return {
            "conversation": conv,
            "tools": tools,
            "documents": plain(docs),
            "template_kwargs": template_kwargs,
            "add_generation_prompt": agp,
            "continue_final_message": cfm,
            "add_special_tokens": add_special,
        }
