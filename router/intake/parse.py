"""Request bodies: JSON parsing and the checks of the fields routing reads (everything else is
forwarded untouched and judged by the replica)."""

from __future__ import annotations

import json
from typing import Any

try:  # an exact, faster parser for the bodies it accepts; the stdlib's for the rest
    import orjson

    _fast_loads: Any = orjson.loads
    _FastError: Any = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is a dependency
    _fast_loads, _FastError = None, ValueError

from router.core.errors import bad_request
from router.intake import json_pieces
from router.intake.routed_request import Endpoint
from router.intake.shapes import DEFAULT_LIMITS, BodyLimits, check_body

# vLLM stores token counts and choice counts in int32-sized fields; anything beyond is refused
# (and a bigger int breaks float arithmetic: the first-byte estimate overflowed on n=10**400).
MAX_INT = 2**31 - 1
# Integer fields something in the gateway reads (routing, the salt, the first-byte estimate,
# the context check, whether the replica reads its prefix cache), with vLLM's lower bounds:
# field -> (lowest, endpoints it is an integer on).
_ALL: tuple[Endpoint, ...] = ("chat", "completions", "messages", "responses")
INT_FIELDS: dict[str, tuple[int, tuple[Endpoint, ...]]] = {
    "n": (1, ("chat", "completions")),
    "best_of": (1, ("chat", "completions")),
    "max_tokens": (0, ("chat", "completions", "messages")),
    "max_completion_tokens": (0, ("chat",)),
    "max_output_tokens": (1, ("responses",)),
    "truncate_prompt_tokens": (-1, ("chat", "completions")),
    "top_logprobs": (-1, ("chat", "responses")),
    "logprobs": (-1, ("completions",)),  # a boolean on chat
    "prompt_logprobs": (-1, ("chat", "completions")),
    "top_k": (-1, _ALL),
}


def check_int_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Every integer field the gateway reads is an integer within vLLM's bounds and
    ``MAX_INT``: a 400 naming the field, before anything uses it."""
    for key, (low, endpoints) in INT_FIELDS.items():
        v = body.get(key)
        if v is None or endpoint not in endpoints:
            continue
        if type(v) is not int or not low <= v <= MAX_INT:
            raise bad_request(f"{key} must be an integer from {low} to {MAX_INT}", key)


def skips_cache_read(body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether vLLM serves this request without reading its prefix cache (it reports
    ``cached_tokens`` 0 however much it holds): prompt logprobs, asked for directly or through
    ``echo`` (``SamplingParams.skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not
    None``; the OpenAI bodies set prompt logprobs from ``top_logprobs`` (chat) or
    ``logprobs`` (completions) when ``echo`` is on)."""
    if endpoint not in ("chat", "completions"):
        return False  # Messages and Responses bodies cannot ask for prompt logprobs
    if body.get("prompt_logprobs") is not None:
        return True
    echoed = body.get("top_logprobs" if endpoint == "chat" else "logprobs")
    return bool(body.get("echo")) and echoed is not None


def forwarded_bytes(raw: bytes, sent: dict[str, Any], body: dict[str, Any]) -> bytes | None:
    """The bytes to forward for ``body``, made from the client's ``raw`` (which parsed as
    ``sent``) without serialising the whole body again (``json.dumps`` of a body near the
    value cap held the GIL ~0.2 s): ``raw`` itself when nothing changed; when ``body`` only
    sets top-level keys (the model's served name, the ``cache_salt`` the tenancy policy
    decided), ``raw`` with those keys appended, since a JSON object's last duplicate key
    wins for ``json.loads`` here and in vLLM alike. None (serialise ``body``) when a key was
    removed or ``raw`` is not UTF-8."""
    if body is sent:
        return raw
    if any(k not in body for k in sent) or json.detect_encoding(raw) != "utf-8":
        return None
    changed = {k: v for k, v in body.items() if k not in sent or sent[k] is not v}
    if not changed:
        return raw
    close = _last_non_space(raw, len(raw))  # the object's closing brace
    if close < 0 or raw[close] != 0x7D:
        return None
    empty = raw[_last_non_space(raw, close)] == 0x7B  # "{}": no comma before the keys
    tail = json.dumps(changed)[1:].encode()  # '"k": v, ...}' without the opening brace
    return b"".join((memoryview(raw)[:close], b"" if empty else b", ", tail))


def _last_non_space(raw: bytes, before: int) -> int:
    """The index of the last byte before ``before`` that is not JSON whitespace (-1: none);
    steps back byte by byte: a body ends in a few spaces at most, and slicing would copy it."""
    i = before - 1
    while i >= 0 and raw[i] in b" \t\r\n":
        i -= 1
    return i


def parse_json_object(raw: bytes, *, whole: bool = False) -> dict[str, Any]:
    """``raw`` as a JSON object, exactly as the stdlib's ``json.loads`` reads it.

    A body that may be costly to parse is parsed in pieces (router/intake/json_pieces.py: no
    call holds the GIL for the whole parse), unless ``whole``: in the checking child,
    where holding it stalls nobody. Otherwise orjson parses what it accepts to the same
    values (tests/test_parse_json.py) in a fraction of the time; whatever it refuses --
    integers beyond 64 bits, NaN and Infinity, lone surrogates, UTF-16/32 or a byte-order
    mark, nesting past 1,024, invalid JSON -- is handed to ``json.loads``, which accepts
    it as before or refuses it with today's message. Duplicate keys: all keep the last
    value at the first key's place."""
    return _parse(raw, whole, False)[0]


def _parse(raw: bytes, whole: bool, wide_ok: bool) -> tuple[dict[str, Any], bool]:
    """``parse_json_object``'s body, and whether it is orjson's reading unchecked for what
    orjson makes of an integer too wide for 64 bits (a whole float of 2**63 or more): with
    ``wide_ok``, that walk is left to the caller (``parse_body``: ``check_body`` walks the
    body anyway), who then reads ``raw`` with ``parse_stdlib``."""
    if not whole and json_pieces.may_be_costly(raw):
        body = _in_pieces(raw)
        if body is not None:
            return body, False
    if _fast_loads is not None:
        try:
            body = _fast_loads(raw)
        except _FastError:
            pass
        else:
            if not isinstance(body, dict):
                raise bad_request("request body must be a JSON object")
            if wide_ok:
                return body, True
            if not _wide_float(body):
                return body, False
            # orjson reads an integer beyond 64 bits as a float: the stdlib keeps it exact.
    return parse_stdlib(raw), False


def parse_stdlib(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, by the stdlib's ``json.loads`` (its error messages)."""
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


_WIDE = float(2**63)


def _wide_float(body: dict[str, Any]) -> bool:
    """Whether ``body`` holds a whole float of 2**63 or more in magnitude: all orjson makes
    of an integer literal too wide for 64 bits (a float literal that large is rare, and the
    stdlib reads it the same)."""
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        for v in node.values() if type(node) is dict else node:
            t = type(v)
            if t is float:
                if (v >= _WIDE or v <= -_WIDE) and v.is_integer():
                    return True
            elif (t is dict or t is list) and v:
                stack.append(v)
    return False


def _in_pieces(raw: bytes) -> dict[str, Any] | None:
    """``raw`` parsed in pieces; None for what ``json.loads`` should judge (not UTF-8, or
    not a valid JSON object: its error messages are the ones clients see)."""
    if json.detect_encoding(raw) != "utf-8":
        return None
    try:
        # surrogatepass: as json.loads decodes bytes (check_body refuses lone surrogates).
        body = json_pieces.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, IndexError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return body if isinstance(body, dict) else None


def parse_body(
    raw: bytes, endpoint: Endpoint, limits: BodyLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """Validate the fields routing reads; everything else is forwarded untouched."""
    body, unchecked = _parse(raw, False, True)
    # Bounded shapes first: what follows recurses. The walk also finds a whole float of
    # 2**63 or more; in orjson's reading it may be an integer too wide for 64 bits, which
    # the stdlib reads exactly (parse_json_object's own check, on the one walk).
    if check_body(body, limits) and unchecked:
        body = parse_stdlib(raw)
        check_body(body, limits)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise bad_request("stream must be a boolean", "stream")
    check_int_fields(body, endpoint)
    if endpoint in ("messages", "responses"):
        return body  # checked by its converter (router/api/)
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("prompt is required", "prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
    return body
