"""Parsing a large JSON text in pieces, so that no single call holds the GIL long.

``json.loads`` is one C call: a body of 1M values (what the body limits admit) held the GIL
55-85 ms on a loaded 2-core host, in a worker thread too, and the event loop answered nothing
meanwhile. ``loads`` here gives the same value for a valid JSON text, built from C calls on
pieces of at most ``PIECE_CHARS``: a run of flat elements of a list (scalars, or objects and
lists of scalars) or members of an object is cut at its last comma within the piece and
parsed whole; an element that is neither (a nested container, a string longer than a piece)
is descended into, or scanned alone. Between pieces the interpreter can hand the GIL to the
event loop. The text must be valid JSON (router/intake/json_check.py checked it in another process
first); anything unexpected raises ``ValueError``, and the caller parses it whole instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

PIECE_CHARS = 64 * 1024
INLINE_BYTES = 2 * 1024 * 1024  # larger bodies are always costly to parse
INLINE_VALUES = 100_000  # a parse of this many values holds the GIL for a few ms
COUNT_FROM_BYTES = 64 * 1024  # below this, a body is cheap without counting

_STR = r'"(?:[^"\\]|\\.)*"'
_SCALAR = rf"(?:-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|{_STR}|true|false|null)"
_WS = r"[ \t\n\r]*"
_FLAT = (
    rf"(?:{_SCALAR}"
    rf"|\[{_WS}(?:{_SCALAR}{_WS}(?:,{_WS}{_SCALAR}{_WS})*)?\]"
    rf"|\{{{_WS}(?:{_STR}{_WS}:{_WS}{_SCALAR}{_WS}(?:,{_WS}{_STR}{_WS}:{_WS}{_SCALAR}{_WS})*)?\}})"
)
# A run of flat list elements / object members, each followed by its comma.
_ELEMENTS = re.compile(rf"(?:{_WS}{_FLAT}{_WS},)+")
_MEMBERS = re.compile(rf"(?:{_WS}{_STR}{_WS}:{_WS}{_FLAT}{_WS},)+")
_SPACE = re.compile(_WS)
# No string or container: every comma in it ends an element (numbers, true, false, null).
_PLAIN = re.compile(r'[^"\[\]{}]*')
# The stdlib's C scanner: one value from an index, as json.loads reads it.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def may_be_costly(raw: bytes) -> bool:
    """Whether parsing ``raw`` whole could hold the GIL long: megabytes, or more values than
    ``INLINE_VALUES`` (every value but the first follows a ``[``, ``,`` or ``:``, so their
    count bounds the values; a string holding them only over-counts)."""
    if len(raw) > INLINE_BYTES:
        return True
    if len(raw) <= COUNT_FROM_BYTES:
        return False
    return raw.count(b",") + raw.count(b":") + raw.count(b"[") > INLINE_VALUES


def loads(text: str) -> Any:
    """``json.loads(text)`` for a valid JSON text, in pieces (see the module docstring)."""
    value, end = _value(text, _SPACE.match(text, 0).end())  # type: ignore[union-attr]
    if _SPACE.match(text, end).end() != len(text):  # type: ignore[union-attr]
        raise ValueError("extra data")
    return value


def _value(s: str, i: int) -> tuple[Any, int]:
    c = s[i]
    if c == "[":
        return _list(s, i)
    if c == "{":
        return _object(s, i)
    return _one(s, i)


def _one(s: str, i: int) -> tuple[Any, int]:
    try:
        return _scan(s, i)
    except StopIteration:
        raise ValueError(f"no JSON value at {i}") from None


def _list(s: str, i: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    i = _skip(s, i + 1)
    if s[i] == "]":
        return out, i + 1
    while True:
        plain = _PLAIN.match(s, i, i + PIECE_CHARS).end()  # type: ignore[union-attr]
        cut = s.rfind(",", i, plain)
        if cut > i:  # scalars up to ``cut``: one C call
            out.extend(_one("[" + s[i:cut] + "]", 0)[0])
            i = _skip(s, cut + 1)
            continue
        run = _ELEMENTS.match(s, i, i + PIECE_CHARS)
        if run is not None:  # many flat elements: one C call
            out.extend(_one("[" + s[i : run.end() - 1] + "]", 0)[0])
            i = _skip(s, run.end())
            continue
        v, i = _value(s, i)
        out.append(v)
        i = _skip(s, i)
        if s[i] == "]":
            return out, i + 1
        if s[i] != ",":
            raise ValueError(f"expected , or ] at {i}")
        i = _skip(s, i + 1)


def _object(s: str, i: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    i = _skip(s, i + 1)
    if s[i] == "}":
        return out, i + 1
    while True:
        run = _MEMBERS.match(s, i, i + PIECE_CHARS)
        if run is not None:  # many flat members (a repeated key keeps its first place)
            out.update(_one("{" + s[i : run.end() - 1] + "}", 0)[0])
            i = _skip(s, run.end())
            continue
        key, i = _one(s, i)
        if not isinstance(key, str):
            raise ValueError(f"expected a key at {i}")
        i = _skip(s, i)
        if s[i] != ":":
            raise ValueError(f"expected : at {i}")
        out[key], i = _value(s, _skip(s, i + 1))
        i = _skip(s, i)
        if s[i] == "}":
            return out, i + 1
        if s[i] != ",":
            raise ValueError(f"expected , or }} at {i}")
        i = _skip(s, i + 1)


def _skip(s: str, i: int) -> int:
    return _SPACE.match(s, i).end()  # type: ignore[union-attr]
