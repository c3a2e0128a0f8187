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
- ``render`` builds the context from a dict of the template's globals copied once;
- an output of a sum (``{{ '<|im_start|>' + message.role + '\n' + content }}``) whose terms
  are all strings is yielded term by term: each ``+`` copied the text so far (a 20 KB
  system prompt twice per render), and the render joins the pieces anyway. A term that is
  not a string takes the sum as written, from there on (``_SumOutput``).

Everything else (``str.format``, namespaces, undefined values, unsafe attributes) takes the
stock path. tests/prompt/test_sandbox.py renders templates and conversations with both
environments and compares the text and the errors.
"""

from __future__ import annotations

import types
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context

_DICT_ATTRIBUTES = frozenset(dir(dict))
_BUILTIN_METHOD = types.BuiltinMethodType
_STOP_ITERATION = "value was undefined because a callable raised a StopIteration exception"


_MAX_TERMS = 8  # sums of more terms are output as written


class _SumOutput(CodeGenerator):
    """Compiles ``{{ a + b + c }}`` as

        t_1 = a
        if type(t_1) is str:
            t_2 = b
            if type(t_2) is str:
                t_3 = c
                if type(t_3) is str:
                    yield t_1; yield t_2; yield t_3
                else:
                    yield str(((t_1 + t_2) + t_3))
            else:
                yield str(((t_1 + t_2) + c))
        else:
            yield str(((t_1 + b) + c))

    Every term is evaluated once, in its place; the one thing moved is the concatenation of
    strings, which cannot fail or do anything else, so the text and any error are those of
    the sum as written. Only where output is yielded as it is (not into a buffer, no
    autoescaping, no finalize, ``+`` not intercepted)."""

    def visit_Output(self, node: nodes.Output, frame: Frame) -> None:
        if not self._yields_plainly(frame) or not any(isinstance(c, nodes.Add) for c in node.nodes):
            super().visit_Output(node, frame)
            return
        run: list[nodes.Expr] = []
        for child in node.nodes:
            terms = _terms(child, frame)
            if terms is None:
                run.append(child)
                continue
            if run:
                super().visit_Output(nodes.Output(run, lineno=node.lineno), frame)
                run = []
            if frame.require_output_check:
                if self.has_known_extends:
                    return
                self.writeline("if parent_template is None:")
                self.indent()
            self._sum(terms, frame)
            if frame.require_output_check:
                self.outdent()
        if run:
            super().visit_Output(nodes.Output(run, lineno=node.lineno), frame)

    def _yields_plainly(self, frame: Frame) -> bool:
        return (
            frame.buffer is None
            and not frame.eval_ctx.volatile
            and not frame.eval_ctx.autoescape
            and self._make_finalize().src is None
            and "+" not in self.environment.intercepted_binops  # type: ignore[attr-defined]
        )

    def _sum(self, terms: list[nodes.Expr], frame: Frame) -> None:
        # A constant string term is written as its literal and needs no check.
        names: list[str] = []
        checked: list[int] = []
        for i, term in enumerate(terms):
            if isinstance(term, nodes.Const) and type(term.value) is str:
                names.append(repr(term.value))
                continue
            name = self.temporary_identifier()
            names.append(name)
            checked.append(i)
            self.writeline(f"{name} = ", term)
            self.visit(term, frame)
            self.writeline(f"if type({name}) is str:")
            self.indent()
        for name in names:
            self.writeline(f"yield {name}")
        for i in reversed(checked):
            self.outdent()
            self.writeline("else:")
            self.indent()
            self.writeline("yield str(" + "(" * (len(terms) - 1) + names[0])
            for j in range(1, len(terms)):
                self.write(" + ")
                if j <= i or names[j][0] in "'\"":
                    self.write(names[j])
                else:
                    self.visit(terms[j], frame)
                self.write(")")
            self.write(")")
            self.outdent()


def _terms(node: nodes.Expr, frame: Frame) -> list[nodes.Expr] | None:
    """The terms of a sum ``a + b + c`` (left to right), or None: not a sum, a sum folded
    at compile time, or one of too many terms."""
    if not isinstance(node, nodes.Add):
        return None
    try:
        node.as_const(frame.eval_ctx)
    except Exception:  # not a constant (Impossible), or one left to fail at run time
        pass
    else:
        return None
    terms: list[nodes.Expr] = []
    while isinstance(node, nodes.Add):
        terms.append(node.right)
        node = node.left
    terms.append(node)
    return terms[::-1] if len(terms) <= _MAX_TERMS else None


class ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the shortcuts above (same results)."""

    code_generator_class = _SumOutput

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
