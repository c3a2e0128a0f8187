"""router.core.salt: vLLM's cache_salt rule, the one check the renderer, the tenancy policy and the
simulated replica share (so they cannot disagree on what is valid)."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.sim.protocol import cache_salt
from router.core.errors import APIError
from router.core.salt import validate_cache_salt
from tests.prompt.common import renderer

EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
SHAPE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\', or NUL."
)


@pytest.mark.parametrize("salt", [None, "x", "x" * 128, "pra-0123abc", "a.b_c-d:e"])
def test_valid_salts_pass(salt: Any) -> None:
    validate_cache_salt(salt)


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", EMPTY),
        (7, EMPTY),
        (True, EMPTY),
        (["x"], EMPTY),
        ("x" * 129, SHAPE),
        ("a@b", SHAPE),
        ("a/b", SHAPE),
        ("a\\b", SHAPE),
        ("a\x00b", SHAPE),
    ],
)
def test_invalid_salts_get_vllms_message(salt: Any, message: str) -> None:
    bodies = [{"messages": [{"role": "user", "content": "u"}], "cache_salt": salt}]
    checks = [
        lambda: validate_cache_salt(salt),
        lambda: renderer(True).tokenize_chat(bodies[0]),
        lambda: renderer(False).tokenize_completion_request({"prompt": "p", "cache_salt": salt}),
        lambda: cache_salt({"cache_salt": salt}),  # the simulated replica
    ]
    for check in checks:
        with pytest.raises(APIError) as exc:
            check()
        assert exc.value.status == 400
        assert exc.value.param == "cache_salt"
        assert exc.value.message == message
