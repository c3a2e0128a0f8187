"""The chat-template Jinja environment, as transformers 5.22 ``_cached_compile_jinja_template``
builds it, and vLLM's content-format detection on a template's AST.

Rendering the compiled template directly (not ``tokenizer.apply_chat_template``) keeps the
output fixed to what the vLLM 0.34.0 oracle's transformers did: later releases changed what
``apply_chat_template`` does to messages (5.24 drops ``None``-valued keys).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from router.prompt.sandbox import ChatSandbox

ContentFormat = Literal["string", "openai"]

log = logging.getLogger("router.prompt.jinja")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (assistant-mask tracking is
    not needed here)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def jinja_env(
    sandbox: type[jinja2.sandbox.ImmutableSandboxedEnvironment] = ChatSandbox,
) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment templates are compiled in; ``sandbox``: the stock class (tests compare
    it with ChatSandbox, its shortcuts, router/prompt/sandbox.py)."""
    env = sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def template_error_reason(exc: BaseException) -> str:
    """The most specific reason in a template error chain (vllm.renderers.hf)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    # Anything else is Python's own text (a TypeError naming internals): logged, not echoed.
    log.debug("chat template failed: %s: %.300s", type(exc).__name__, exc)
    return "a value in the request has a type or shape the template cannot render"


# --------------------------------------------------------------------------------------------
# Content-format detection (vllm.renderers.hf._detect_content_format, ported): does the
# template loop over ``message.content``? Then content is handed over as a list of parts
# ("openai"), else as one string ("string"; Qwen3 is "string").
# --------------------------------------------------------------------------------------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _attr_dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _iter_assign_var_or_elems(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    yield varname
    seen = {varname}
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, name):
                yield lhs.name
                if lhs.name != name and lhs.name not in seen:
                    seen.add(lhs.name)
                    related.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems_access(kw.value, name)
                ]
            elif isinstance(
                lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)
            ) and _is_var_or_elems_access(rhs, name):
                dotted = _attr_dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != name and alias not in seen:
                    seen.add(alias)
                    related.append(alias)


def _message_loop_vars(root: jinja2.nodes.Node) -> list[str]:
    names = list(_iter_assign_var_or_elems(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        for name in names:
            if _is_var_or_elems_access(loop.iter, name) and isinstance(
                loop.target, jinja2.nodes.Name
            ):
                out.append(loop.target.name)
                break
    return out


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    message_vars = _message_loop_vars(root)
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                        _is_var_or_elems_access(arg, v, "content") for v in message_vars
                    ):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in param_names and any(
                        _is_var_or_elems_access(kw.value, v, "content") for v in message_vars
                    ):
                        content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_vars):
            return True
        params = params_by_loop.get(id(loop))
        if (
            isinstance(loop.iter, jinja2.nodes.Name)
            and params is not None
            and loop.iter.name in params
        ):
            return True
        if (
            id(loop) not in loops_in_macros
            and isinstance(loop.iter, jinja2.nodes.Name)
            and loop.iter.name == "content"
        ):
            return True
    return False


def detect_content_format(env: jinja2.Environment, template: str) -> ContentFormat:
    try:
        return "openai" if _loops_over_content(env.parse(template)) else "string"
    except Exception:  # vLLM falls back to "string" when the AST cannot be analysed
        return "string"
