"""Large bodies within the limits: parsed in pieces (router/intake/json_pieces.py) to the very value
``json.loads`` makes, and forwarded as the client's bytes with the keys the gateway changed
appended (router/intake/parse.py ``forwarded_bytes``), never serialised again whole."""

from __future__ import annotations

import gzip
import json
from typing import Any

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from router.intake import json_pieces
from router.intake.parse import forwarded_bytes, parse_json_object
from tests.helpers import chat_body

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
    | st.sampled_from(["a,b]", '"q"', "\\", "}{", "\n", "x:y"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=60,
)


def same(a: Any, b: Any) -> bool:
    """Equal values, types and key order all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), values, max_size=6), st.sampled_from([None, 1, 2]))
def test_pieces_give_what_json_loads_gives(body: dict[str, Any], indent: int | None) -> None:
    text = json.dumps(body, indent=indent)
    assert same(json_pieces.loads(text), json.loads(text))


def test_pieces_cut_long_runs_and_keep_every_value(monkeypatch: Any) -> None:
    # Small pieces, so every run below is cut many times (at commas inside strings too).
    monkeypatch.setattr(json_pieces, "PIECE_CHARS", 50)
    body = {
        "prompt": list(range(-500, 500)),
        "enum": [f"v,{i}]" for i in range(300)],
        "flat": [{"a": i, "b": [1, "x"], "c": None} for i in range(200)],
        "deep": [[[i, {"k": [i]}]] for i in range(100)],
        "bias": {str(i): -1.5 for i in range(300)},
        "long": "s" * 500,
        "odd": [1e300, -0.0, 2**80, True, False, None, '\u00e9\\"', []],
    }
    for indent in (None, 0, 3):
        text = json.dumps(body, indent=indent)
        assert same(json_pieces.loads(text), json.loads(text))
    # A repeated key keeps its first place and its last value, as json.loads does.
    text = '{"a": 1, "b": 2, ' + ", ".join(f'"k{i}": {i}' for i in range(50)) + ', "a": 3}'
    assert same(json_pieces.loads(text), json.loads(text))


def test_a_costly_body_parses_to_the_same_object() -> None:
    raw = json.dumps(
        {"model": "m", "prompt": [1000] * 200_000, "nan": float("nan")}, allow_nan=True
    ).encode()
    got, want = parse_json_object(raw), json.loads(raw)
    assert list(got) == list(want) and got["prompt"] == want["prompt"]
    assert got["nan"] != got["nan"]  # NaN, as json.loads reads it


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


async def post_gzip(url: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(url + "/v1/chat/completions", data=raw, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_a_body_inflating_past_two_mib_is_inflated_by_the_checking_child(fleet, gateway):
    """A compressed body is inflated here only up to 2 MiB: past that the checking child
    inflates and checks it (a bomb never costs this process more), and it is inflated here
    once it passed. Before, every compressed body was inflated whole here first, and one too
    large or corrupt was refused before any check."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_body_bytes=4 * 1024 * 1024)
    checks = gw.gateway.metrics.registry.get_sample_value
    served = chat_body("large", metadata={"pad": "u" * 3_000_000})
    status, body = await post_gzip(gw.url, gzip.compress(json.dumps(served).encode()))
    assert status == 200, body
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) == 1
    assert replicas[0].stats["records"][-1]["prompt_tokens"] > 0  # forwarded, decoded

    too_large = chat_body("large", metadata={"pad": "u" * 5_000_000})
    status, body = await post_gzip(gw.url, gzip.compress(json.dumps(too_large).encode()))
    assert status == 413, body
    corrupt = gzip.compress(json.dumps(served).encode())[:-9]  # no end of stream
    status, body = await post_gzip(gw.url, corrupt)
    assert status == 400 and body["error"]["code"] == "invalid_content_encoding", body
    assert checks("prefix_router_json_checks_total", {"outcome": "refused"}) == 2

    small = gzip.compress(json.dumps(chat_body("small")).encode())  # inflated here, unchecked
    status, body = await post_gzip(gw.url, small)
    assert status == 200, body
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) == 1
