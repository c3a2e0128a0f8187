"""Large bodies within the limits: forwarded as the client's bytes with the keys the gateway
changed appended (router/parse.py ``forwarded_bytes``), never serialised again whole."""

from __future__ import annotations

import json
from typing import Any

from router.parse import forwarded_bytes


def same(a: Any, b: Any) -> bool:
    """Equal values, types and key order all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_forwarded_bytes_append_what_changed_to_the_clients_bytes() -> None:
    raw = b'{"model":"alias",  "max_tokens": 1.50e0, "x": [1, 2]} \n'
    sent = json.loads(raw)
    body = {**sent, "model": "served", "cache_salt": "s"}
    out = forwarded_bytes(raw, sent, body)
    assert out is not None and out.startswith(raw[: raw.rindex(b"}")])  # not re-serialised
    assert same(json.loads(out), body)
    assert forwarded_bytes(raw, sent, sent) is raw
    assert forwarded_bytes(raw, sent, dict(sent)) == raw  # a copy with nothing changed
    assert same(json.loads(forwarded_bytes(b"{ }", {}, {"k": 1}) or b""), {"k": 1})


def test_forwarded_bytes_serialise_when_a_key_goes_or_the_text_is_not_utf8() -> None:
    raw = b'{"model": "m", "cache_salt": "mine"}'
    sent = json.loads(raw)
    assert forwarded_bytes(raw, sent, {"model": "m"}) is None  # the salt removed
    utf16 = '{"model": "m"}'.encode("utf-16")
    assert forwarded_bytes(utf16, {"model": "m"}, {"model": "m", "cache_salt": "s"}) is None
