"""The request's parameters for the chat template, as vLLM 0.34.0 builds them: ``tools`` (as
its request model dumps them), ``tool_choice`` checks, and ``chat_template_kwargs`` (merged
with reasoning_effort / documents and the server defaults, then filtered to what the template
or transformers' ``apply_chat_template`` accepts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.prompt.fields import error, lax_bool, plain

_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_UNSET = (None, "auto")  # vllm.renderers.params.merge_kwargs: override values that are ignored

# Parameters of transformers' ``apply_chat_template`` (5.22): vLLM lets request
# chat_template_kwargs through when they are one of these or a variable of the template
# (vllm.renderers.hf.resolve_chat_template_kwargs).
_HF_CHAT_PARAMS = frozenset(
    {
        "self",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# Passing one of these as a chat_template_kwarg makes a Python call in vLLM fail with
# "got multiple values for argument ..." (a rejected request): safe_apply_chat_template's own
# parameters (checked before the kwargs are filtered), and apply_chat_template's / the
# template's (checked after).
_COLLIDING_KWARGS_ANY = frozenset({"model_config", "tokenizer", "conversation"})
_COLLIDING_KWARGS = frozenset({"self", "messages"})


def tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Tools as vLLM's ChatCompletionToolsParam(...).model_dump() gives them: key order
    type, function{name, description, parameters[, strict][, defer_loading]}
    [, defer_loading]; unknown keys dropped; missing description/parameters -> null."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise error("'tools' must be a list", "tools")
    out = []
    for j, tool in enumerate(tools):
        param = f"tools.{j}"
        if not isinstance(tool, dict):
            raise error(f"tools[{j}] must be an object", param)
        if tool.get("type", "function") != "function":
            raise error(f"tools[{j}].type must be 'function'", param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise error(f"tools[{j}].function must be an object", param)
        name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters")
        strict = fn.get("strict")
        defer = tool.get("defer_loading")
        fn_defer = fn.get("defer_loading")
        if not isinstance(name, str):
            raise error(
                f"tools[{j}].function.name is required and must be a string",
                f"{param}.function.name",
            )
        if desc is not None and not isinstance(desc, str):
            raise error(f"tools[{j}].function.description must be a string", param)
        if params is not None and not isinstance(params, dict):
            raise error(f"tools[{j}].function.parameters must be an object", param)
        flags = []
        for key, flag in (
            ("strict", strict),
            ("defer_loading", fn_defer),
            ("defer_loading", defer),
        ):
            value = None if flag is None else lax_bool(flag)
            if flag is not None and value is None:
                raise error(f"tools[{j}] {key} must be a boolean", param)
            flags.append(value)
        strict, fn_defer, defer = flags
        if defer is not None and fn_defer is None:
            fn_defer = defer
        function: dict[str, Any] = {
            "name": name,
            "description": desc,
            "parameters": plain(params),
        }
        if strict is not None:
            function["strict"] = strict
        if fn_defer is not None:
            function["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def check_tool_choice(body: Mapping[str, Any]) -> None:
    """The parts of vLLM's check_tool_usage that reject a request."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools == [] and not isinstance(choice, dict):
        tools = None
        if choice in ("auto", "required"):
            choice = "none"
    if choice is None or choice == "none":
        return
    if tools is None:
        raise error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise error(
                "tool_choice must name a function: "
                '{"type": "function", "function": {"name": "my_function"}}',
                "tool_choice.function.name",
            )
        if not any(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and t["function"].get("name") == name
            for t in tools
        ):
            raise error(
                f"The tool `{name}` specified in `tool_choice` does not match any "
                "of the specified `tools`",
                "tool_choice",
            )
    elif choice not in ("auto", "required"):
        raise error(
            f"Invalid value for `tool_choice`: {choice}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            "tool_choice",
        )


def chat_kwargs(
    body: Mapping[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    defaults: Mapping[str, Any],
) -> dict[str, Any]:
    """The chat_template kwargs vLLM ends up passing (ChatCompletionRequest.
    build_chat_params + preprocess_chat's defaults + merge_kwargs' unset rule)."""
    user = body.get("chat_template_kwargs")
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise error("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if user.get("chat_template") is not None or body.get("chat_template") is not None:
        raise error(
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template.",
            "chat_template",
        )
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise error(
            "'reasoning_effort' must be one of " + ", ".join(_REASONING_EFFORTS),
            "reasoning_effort",
        )
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list)
        and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
        )
    ):
        raise error("'documents' must be a list of objects with string values", "documents")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    merged = dict(user)
    merged.update({k: v for k, v in extra.items() if v not in _UNSET})
    # ChatParams.with_defaults: the server's --default-chat-template-kwargs, overridden
    # by the request's (unset values do not override)
    out = dict(defaults)
    out.update({k: v for k, v in merged.items() if v not in _UNSET})
    return out


# A template's variables -> the kwargs it accepts (the same set for all its requests).
_ACCEPTED: dict[frozenset[str], frozenset[str]] = {}


def template_kwargs(
    kwargs: Mapping[str, Any], variables: frozenset[str], special_tokens_map: Mapping[str, Any]
) -> tuple[dict[str, Any], Any]:
    """vLLM's resolve_chat_template_kwargs: keep what the template or apply_chat_template
    knows, reject what would collide with a Python parameter, and split off the documents.
    Returns (the kwargs the template is rendered with, the documents)."""
    accepted = _ACCEPTED.get(variables)
    if accepted is None:
        if len(_ACCEPTED) >= 64:  # one entry per template seen: a handful
            _ACCEPTED.clear()
        accepted = _ACCEPTED[variables] = (variables | _HF_CHAT_PARAMS) - {
            "chat_template",
            "tokenize",
        }
    for k in kwargs:
        if k in _COLLIDING_KWARGS_ANY:
            raise error(f"chat_template_kwargs may not set {k!r}", "chat_template_kwargs")
    kept = {k: v for k, v in kwargs.items() if k in accepted and k != "tools"}
    for k in kept:
        if k in _COLLIDING_KWARGS:
            raise error(f"chat_template_kwargs may not set {k!r}", "chat_template_kwargs")
    if kept.get("return_assistant_tokens_mask"):
        raise error(
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`",
            "chat_template_kwargs",
        )
    if kept.get("sanitize_control_tokens"):
        raise error(
            "`sanitize_control_tokens=True` requires `tokenize=True`", "chat_template_kwargs"
        )
    docs = kept.pop("documents", None)
    if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
        raise error(
            "Documents should be a list of dicts with 'title' and 'text' keys!", "documents"
        )
    for k in (
        "add_generation_prompt",
        "continue_final_message",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
    ):
        kept.pop(k, None)
    return {**special_tokens_map, **plain(kept)}, docs
