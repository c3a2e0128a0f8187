"""The chat-template sandbox: Jinja's ``ImmutableSandboxedEnvironment`` with the same answers,
found with less work on the paths a chat template takes for every message.

Rendering Qwen3's template over a two-message chat cost ~0.5M instructions, most of it the
sandbox's bookkeeping rather than the template: ``message.role`` on a dict first tries a Python
attribute (an ``AttributeError`` formatted and thrown away), every attribute is checked with
~10 ``isinstance`` calls (four of them against ABCs), every call of ``str.startswith`` goes
through ``Context.call``'s introspection, and each render copies the globals out of a
``ChainMap`` in Python. Here:

- ``getattr`` on a plain ``dict`` whose type has no attribute of that name is the subscript
  the sandbox falls back to (a builtin type's attributes cannot change);
- whether an attribute is safe is remembered per (type, name): ``is_safe_attribute`` of
  this environment looks at the object only through ``isinstance`` (it ignores the value),
  so for one type and name it always answers the same;
- a builtin method (``str.startswith``...) is called directly: no attribute can be set on
  one, so ``is_safe_callable`` is true and ``Context.call`` passes it nothing;
- ``render`` builds the context from a dict of the template's globals copied once.

Everything else (``str.format``, namespaces, undefined values, unsafe attributes) takes the
stock path. tests/prompt/test_sandbox.py renders templates and conversations with both
environments and compares the text and the errors.
"""

from __future__ import annotations

import types
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2.runtime import Context

_DICT_ATTRIBUTES = frozenset(dir(dict))
_BUILTIN_METHOD = types.BuiltinMethodType
_STOP_ITERATION = "value was undefined because a callable raised a StopIteration exception"


class ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the shortcuts above (same results)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe: dict[tuple[type, str], bool] = {}
        self._globals: dict[int, tuple[jinja2.Template, dict[str, Any]]] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        t = type(obj)
        if t is dict and attribute not in _DICT_ATTRIBUTES:
            # The stock path: getattr raises AttributeError, then the subscript.
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        fmt = self.wrap_str_format(value)
        if fmt is not None:
            return fmt
        safe = self._safe.get((t, attribute))
        if safe is None:
            safe = self._safe[(t, attribute)] = self.is_safe_attribute(obj, attribute, value)
        if safe:
            return value
        return self.unsafe_undefined(obj, attribute)

    def call(
        __self,  # noqa: N805 - Jinja's signature: keyword arguments may be named "self"
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if type(__obj) is _BUILTIN_METHOD and type(__context) is Context:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            try:
                return __obj(*args, **kwargs)
            except StopIteration:
                return __self.undefined(_STOP_ITERATION)
        return super().call(__context, __obj, *args, **kwargs)

    def render(self, template: jinja2.Template, variables: dict[str, Any]) -> str:
        """``template.render(**variables)``, the context built from a copy of the
        template's globals made once (``Template.new_context`` copies its ``ChainMap`` in
        Python on every call)."""
        held = self._globals.get(id(template))
        if held is None or held[0] is not template:
            held = self._globals[id(template)] = (template, dict(template.globals))
        ctx = self.context_class(
            self, dict(held[1], **variables), template.name, template.blocks, template.globals
        )
        try:
            return self.concat(template.root_render_func(ctx))
        except Exception:
            self.handle_exception()
