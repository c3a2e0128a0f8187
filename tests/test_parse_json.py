"""Request bodies are read exactly as the stdlib's ``json.loads`` reads them, though orjson
parses most of them (router/intake/parse.py): same values, same types, same key order, the same
refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import APIError
from router.intake.parse import parse_body, parse_json_object
from router.intake.shapes import check_body

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


def _same(raw: bytes) -> None:
    try:
        expected: Any = json.loads(raw)
    except (ValueError, RecursionError):
        with pytest.raises(APIError):
            parse_json_object(raw)
        return
    if not isinstance(expected, dict):
        with pytest.raises(APIError):
            parse_json_object(raw)
        return
    got = parse_json_object(raw)
    assert repr(got) == repr(expected)  # types, -0.0, key order included


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8), _values, max_size=6),
    st.booleans(),
    st.sampled_from([None, 2]),
)
def test_bodies_read_as_the_stdlib_reads_them(
    body: dict[str, Any], ascii_: bool, indent: Any
) -> None:
    _same(json.dumps(body, ensure_ascii=ascii_, indent=indent).encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1, "a": 2, "b": 3}',  # duplicate keys: the last value, at the first place
        b'{"a": {"k": 1}, "b": 0, "a": [1]}',
        b'{"max_tokens": 123456789012345678901234567890}',  # wider than 64 bits: exact
        b'{"x": -9223372036854775809}',
        b'{"x": 18446744073709551615}',
        b'{"x": 18446744073709551616}',
        b'{"x": [1, {"y": 1e19}]}',
        b'{"x": 1e400}',
        b'{"x": NaN, "y": -Infinity}',
        b'{"s": "\\ud800"}',  # a lone surrogate
        b'\xef\xbb\xbf{"bom": 1}',
        '{"utf16": 1}'.encode("utf-16"),
        b'{"s": "\xed\xa0\x80"}',  # a UTF-8-encoded surrogate
        b'{"s": "\xff"}',
        b'{"a": 1,}',
        b'{"a": "\x01"}',
        b"  \n ",
        b"",
        b"[1, 2]",
        b'"text"',
        b"[" * 3000 + b"]" * 3000,
        b'{"a":' * 1100 + b"1" + b"}" * 1100,
        b'{"x": -0, "y": -0.0, "z": 1.0, "w": 1E2}',
    ],
)
def test_edge_cases_read_as_the_stdlib_reads_them(raw: bytes) -> None:
    _same(raw)


def test_a_wide_integer_stays_an_integer() -> None:
    body = parse_json_object(b'{"max_tokens": 123456789012345678901234567890}')
    assert body["max_tokens"] == 123456789012345678901234567890
    assert type(body["max_tokens"]) is int


def _same_body(raw: bytes) -> None:
    """parse_body reads a chat body as the stdlib does, or refuses it as check_body refuses
    the stdlib's reading (its walk also finds orjson's reading of a too-wide integer)."""
    expected = json.loads(raw)
    try:
        check_body(expected)
    except APIError as e:
        with pytest.raises(APIError) as got:
            parse_body(raw, "chat")
        assert got.value.message == e.message
        return
    assert repr(parse_body(raw, "chat")) == repr(expected)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _values, max_size=6), st.booleans())
def test_chat_bodies_read_as_the_stdlib_reads_them(body: dict[str, Any], ascii_: bool) -> None:
    # The drawn keys under "extra" and "x": a drawn "n" or "stream" could be refused.
    chat = {"model": "m", "extra": body, "messages": [{"role": "user", "content": "hi", "x": body}]}
    _same_body(json.dumps(chat, ensure_ascii=ascii_).encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "value",
    [b"123456789012345678901234567890", b"-9223372036854775809", b"1e19", b'[1, {"y": 1e300}]'],
)
def test_a_chat_body_with_a_wide_number(value: bytes) -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + value + b"}"
    _same_body(raw)
