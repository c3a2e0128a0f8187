"""The simulator's own chat rendering, as vLLM 0.34 does it, without the gateway's renderer.

vLLM loads the tokenizer from the model directory (``AutoTokenizer.from_pretrained``: its
``config.json`` decides the tokenizer class where transformers consults it;
vllm/tokenizers/registry.py, ``truncation_side="left"``), renders a chat request with
transformers' ``apply_chat_template(tokenize=False)`` (vllm/entrypoints/chat_utils.py,
``apply_hf_chat_template``) and encodes the text without special tokens. The gateway renders
with its own code (router/prompt/); a parity probe against a replica is only worth something
when the replica's side is not that code, so this module shares none of it.

It takes the plain requests (string or text-part contents, tools, tool calls, the template
switches); ``Unsupported`` says a body uses something else (truncation, documents, reasoning
effort, media, kv_transfer_params...), which the simulator then renders with the gateway's
renderer. ``tests/test_sim_vllm_chat.py`` checks it against the vLLM oracle's fixtures.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtest.sim.prefix_encode import PrefixEncoder


class Unsupported(Exception):
    """A body this module does not render (the caller uses the full renderer)."""


_BODY_KEYS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "n",
    "stop",
    "ignore_eos",
    "min_tokens",
    "cache_salt",
    "user",
    "return_token_ids",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
    "response_format",
}
_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


def load_chat_template(value: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file's path, else the template text itself
    (vllm/entrypoints/chat_utils.py, ``load_chat_template``)."""
    if value is None:
        return None
    p = Path(value).expanduser()
    if p.is_file():
        return p.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a template")


def load_tokenizer(path: str) -> Any:
    """The tokenizer as vLLM's server loads it from a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, truncation_side="left")


class VllmChat:
    """Chat bodies -> prompt token ids, through transformers as vLLM calls it."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.encoder = PrefixEncoder(tokenizer)  # a long conversation's next turn: its new text
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(self.template, str):
            self.template = None  # a dict of named templates, or none: leave to the renderer

    def tokenize_chat(self, body: Mapping[str, Any]) -> list[int]:
        if self.template is None:
            raise Unsupported("no single chat template")
        if set(body) - _BODY_KEYS:
            raise Unsupported(f"fields {sorted(set(body) - _BODY_KEYS)}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unsupported("messages")
        conversation = [self._message(m) for m in messages]
        tools = self._tools(body.get("tools"))
        if body.get("tool_choice") not in (None, "none", "auto", "required"):
            raise Unsupported("a named tool_choice")
        add_gen = body.get("add_generation_prompt", True)
        cont = body.get("continue_final_message", False)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(add_gen, bool) or not isinstance(cont, bool) or add_gen and cont:
            raise Unsupported("template switches")
        if not isinstance(kwargs, dict) or set(kwargs) & {"messages", "tools", "conversation"}:
            raise Unsupported("chat_template_kwargs")
        if not set(kwargs) <= {"enable_thinking"}:
            raise Unsupported("chat_template_kwargs beyond enable_thinking")
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            tokenize=False,
            **kwargs,
        )
        # Chat prompts are encoded without the tokenizer's special tokens: the template put
        # them in (ChatCompletionRequest.add_special_tokens defaults to False).
        return self.encoder.encode(text)

    @staticmethod
    def _message(m: Any) -> dict[str, Any]:
        if not isinstance(m, dict) or set(m) - _MESSAGE_KEYS:
            raise Unsupported("message keys")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise Unsupported("role")
        content = m.get("content")
        # vLLM's "string" content format: text parts joined with newlines, None as "".
        if content is None:
            if role != "assistant":
                raise Unsupported("null content")
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            text = "\n".join(p["text"] for p in content)
        else:
            raise Unsupported("content")
        if role == "system" and text.startswith("x-anthropic-billing-header"):
            raise Unsupported("billing header")  # vLLM drops that line; the renderer does too
        out: dict[str, Any] = {"role": role, "content": text}
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            out["tool_calls"] = [VllmChat._tool_call(c) for c in calls]
        if role == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if "name" in m:
            out["name"] = m["name"]
        return out

    @staticmethod
    def _tool_call(c: Any) -> dict[str, Any]:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(c.get("id"), str):
            raise Unsupported("tool call")
        args = fn.get("arguments")
        if not isinstance(args, str) or not isinstance(fn.get("name"), str):
            raise Unsupported("tool call function")
        # vLLM hands the template the arguments as a dict (chat_utils: json.loads).
        try:
            parsed = json.loads(args)
        except ValueError:
            raise Unsupported("tool call arguments") from None
        return {
            "id": c["id"],
            "type": "function",
            "function": {"name": fn["name"], "arguments": parsed},
        }

    @staticmethod
    def _tools(tools: Any) -> list[dict[str, Any]] | None:
        if tools is None:
            return None
        if not isinstance(tools, list):
            raise Unsupported("tools")
        out = []
        for t in tools:
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise Unsupported("tool")
            if not isinstance(fn.get("name"), str):
                raise Unsupported("tool")
            if set(t) - {"type", "function"} or set(fn) - {"name", "description", "parameters"}:
                raise Unsupported("tool keys")
            # ChatCompletionToolsParam.model_dump(): every field, None where unset.
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": fn.get("name"),
                        "description": fn.get("description"),
                        "parameters": fn.get("parameters"),
                    },
                }
            )
        return out or None
