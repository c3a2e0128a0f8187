"""The ``disaggregation`` section: prefill/decode replicas and when a request is split
(router/disagg/). Its own module so the P/D settings read in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str) -> Any:
    """A flag field (router/config/sections.py ``_opt``, which imports this module)."""
    meta = {"help": help, "flag": True, "secret": False, "flat": None}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Disaggregation:
    """Prefill/decode disaggregation (router/disagg/): the replicas of each role and when a
    request gets a prefill leg. No prefill replica: every request is served aggregated."""

    prefill_replicas: list[str] = _opt(
        [], "a prefill replica's base URL (vLLM with a NixlConnector; repeatable)"
    )
    decode_replicas: list[str] = _opt(
        [], "a decode replica's base URL (vLLM with a NixlConnector; repeatable)"
    )
    pd_min_prompt_tokens: int = _opt(256, "prompts shorter than this never get a prefill leg")
    pd_min_uncached_tokens: int = _opt(
        256,
        "a request gets a prefill leg only when the chosen decode replica lacks at least this "
        "many of its prompt tokens",
    )
    pd_prefill_policy: str | None = _opt(
        None, "the prefill pool's scheduling policy (default: --policy's)"
    )
    pd_decode_policy: str | None = _opt(
        None,
        "the decode pool's scheduling policy (default: --policy's: prefix-aware, since a "
        "decode replica pulls only the blocks it lacks; least_loaded ignores them)",
    )
    pd_order: str = _opt(
        "decode-first",
        "decode-first: the decode replica is chosen before the prefill leg, and its cache "
        "decides whether to split; prefill-first: chosen again once the prefill leg answered "
        "(on the load then)",
    )
    pd_prefill_dns: str | None = _opt(
        None,
        "discover prefill replicas by resolving this DNS name (port, interval and nameserver: "
        "discovery's)",
    )
    pd_decode_dns: str | None = _opt(None, "discover decode replicas by resolving this DNS name")
