"""The model's chat template: which one a request gets, compiled once, and rendering a
normalised conversation with it (transformers 5.22 ``render_jinja_template``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jinja2
import jinja2.meta
import jinja2.sandbox

from router.core.errors import APIError
from router.prompt.fields import error, prompt_too_long
from router.prompt.jinja import (
    ContentFormat,
    detect_content_format,
    jinja_env,
    template_error_reason,
)
from router.prompt.sandbox import ChatSandbox

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class CompiledTemplate(NamedTuple):
    template: jinja2.Template
    variables: frozenset[str]  # undeclared variables: what chat_template_kwargs may set
    developer: bool  # the template knows the developer role (else developer -> system)
    content_format: ContentFormat


class ChatTemplate:
    """The tokenizer's chat template (or a server-side ``--chat-template`` override)."""

    def __init__(
        self,
        source: Any,
        content_format: ContentFormat | None = None,
        sandbox: type[jinja2.sandbox.ImmutableSandboxedEnvironment] = ChatSandbox,
    ) -> None:
        self._env = jinja_env(sandbox)
        self._source = source  # a template string, or a dict of named templates
        self._compiled: dict[str, CompiledTemplate] = {}
        self._forced_format = content_format

    def resolve(self, tools: Any) -> CompiledTemplate:
        """The compiled template for this request (transformers' ``get_chat_template``), its
        undeclared variables, whether it knows the developer role, and its content format."""
        source = self._source
        if isinstance(source, dict):
            if tools is not None and "tool_use" in source:
                source = source["tool_use"]
            elif "default" in source:
                source = source["default"]
            else:
                raise error("the model has several chat templates and none is the default")
        if not isinstance(source, str):
            raise error(
                "As of transformers v4.44, default chat template is no longer "
                "allowed, so you must provide a chat template if the tokenizer does "
                "not define one."
            )
        hit = self._compiled.get(source)
        if hit is None:
            try:
                compiled = self._env.from_string(source)
                variables = frozenset(
                    jinja2.meta.find_undeclared_variables(self._env.parse(source))
                )
            except jinja2.TemplateError as e:
                raise error(f"the chat template does not compile: {e}") from None
            developer = '"developer"' in source or "'developer'" in source
            fmt = self._forced_format or detect_content_format(self._env, source)
            hit = CompiledTemplate(compiled, variables, developer, fmt)
            self._compiled[source] = hit
        return hit

    def source_for(self, tools: Any) -> str:
        source = self._source
        if isinstance(source, dict):
            source = (
                source.get("tool_use")
                if tools is not None and "tool_use" in source
                else source.get("default")
            )
        return source if isinstance(source, str) else ""

    def render(self, norm: dict[str, Any], max_prompt_chars: int) -> str:
        """transformers' render_jinja_template (5.22), for one normalised conversation."""
        compiled = self.resolve(norm["tools"]).template
        chat = [dict(m) for m in norm["conversation"]]
        for n, m in enumerate(chat):  # _alias_reasoning_fields
            r = None
            for k in _REASONING_KEYS:
                r = m.get(k)
                if r is not None:
                    break
            if r is not None:
                chat[n] = {"thinking": r, **m, "reasoning_content": r}
        cfm = norm["continue_final_message"]
        final = None
        if cfm:
            final = chat[-1].get("content")
            if final is None:
                raise error(
                    "continue_final_message is set but the final message has no "
                    '"content" to continue!',
                    "continue_final_message",
                )
            source = self.source_for(norm["tools"])
            if "content" not in source:
                raise error(
                    'continue_final_message is set to "content" but this is not an '
                    "accepted field in the chat_template",
                    "continue_final_message",
                )
            if isinstance(final, list):
                final = [dict(b) if isinstance(b, dict) else b for b in final]
                chat[-1]["content"] = final
                for block in reversed(final):
                    if isinstance(block, dict) and "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise error(
                        "continue_final_message is set but we could not find any "
                        "text to continue in the final message!",
                        "continue_final_message",
                    )
            else:
                chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            variables = dict(
                messages=chat,
                tools=norm["tools"],
                documents=norm["documents"],
                add_generation_prompt=norm["add_generation_prompt"],
                **norm["template_kwargs"],
            )
            env = self._env
            if isinstance(env, ChatSandbox):
                text = env.render(compiled, variables)
            else:
                text = compiled.render(variables)
        except APIError:
            raise
        except Exception as e:  # never a 500: the template rejected this input
            raise error(
                f"the chat template rejected the request: {template_error_reason(e)}", "messages"
            ) from None
        if cfm:
            assert isinstance(final, str)
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise error(
                    "continue_final_message is set but the final message does not "
                    "appear in the chat after applying the chat template!",
                    "continue_final_message",
                )
            loc = text.rindex(_CONTINUE_TAG.strip())
            if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:loc]
            else:
                text = text[:loc].rstrip()
        if len(text) > max_prompt_chars:
            raise prompt_too_long(max_prompt_chars, len(text))
        return text
