"""vLLM's ``cache_salt`` rule, with vLLM's messages: the one check the renderer, the tenancy
policy and the simulated replica share (a core module: it imports only ``router.core.errors``)."""

from __future__ import annotations

from router.core.errors import bad_request


def validate_cache_salt(salt: object) -> None:
    """vLLM's cache_salt rule: a non-empty string, <= 128 chars, none of ``@ / \\`` or NUL.
    ``None`` (no salt sent) passes."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\', or NUL.",
            "cache_salt",
        )
