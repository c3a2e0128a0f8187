"""The two legs' bodies and what a prefill answer carries (vLLM 0.34, NixlConnector pull mode).

The prefill leg is the client's body as vLLM's own proxy sends it
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py ``send_request_to_service``):
``kv_transfer_params.do_remote_decode``, no stream, one output token, no minimum. It also
asks for the prompt's token ids (``return_token_ids``), which the decode leg forwards inside
its ``kv_transfer_params.prompt_token_ids`` (vLLM 0.34 reads them there and skips rendering,
renderers/online_renderer.py; a top-level field is ignored), so the decode replica's tokens are
the prefill replica's, block for block. The decode leg is the client's body (its own stream
and limits) with the prefill answer's parameters verbatim: unknown keys included, since a
newer vLLM adds fields its decode side needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.intake.routed_request import Endpoint

# What a prefill leg asks of vLLM (pull_scheduler.py: a request with do_remote_decode keeps
# its blocks for the decode side).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The field holding the output limit, per API (chat may also carry max_completion_tokens).
LIMIT_FIELD: dict[Endpoint, str] = {
    "chat": "max_tokens",
    "completions": "max_tokens",
    "messages": "max_tokens",
    "responses": "max_output_tokens",
}
# The APIs whose answers carry ``prompt_token_ids`` when asked (``return_token_ids``).
TOKEN_ID_APIS = frozenset({"chat", "completions"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def prefill_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's (its salt, its prompt) computed for one token."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out.pop("stream_options", None)
    out[LIMIT_FIELD[endpoint]] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    if endpoint in TOKEN_ID_APIS:
        out["return_token_ids"] = True
    if endpoint == "responses":
        out["store"] = False  # the answer the client keeps is the decode replica's
    return out


@dataclass(frozen=True)
class PrefillAnswer:
    """What the prefill replica handed over: its KV transfer parameters (None: it returned
    none, a fleet not configured for P/D) and the prompt's token ids if it sent them."""

    params: dict[str, Any] | None
    prompt_token_ids: list[int] | None


def prefill_answer(endpoint: Endpoint, data: bytes) -> PrefillAnswer:
    """``data`` (a prefill replica's 200 answer) read for what the decode leg needs."""
    try:
        answer = json.loads(data)
    except ValueError:
        return PrefillAnswer(None, None)
    if not isinstance(answer, dict):
        return PrefillAnswer(None, None)
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        params = None
    ids: Any = answer.get("prompt_token_ids")  # chat: top level
    if ids is None and endpoint == "completions":
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    if not (isinstance(ids, list) and all(type(t) is int for t in ids)):
        ids = None
    return PrefillAnswer(params, ids)


def decode_body(body: dict[str, Any], answer: PrefillAnswer) -> dict[str, Any]:
    """The decode leg's body: the client's with the prefill answer's parameters (and its
    prompt ids). Only called with parameters (``answer.params``)."""
    assert answer.params is not None
    params = dict(answer.params)
    if answer.prompt_token_ids is not None:
        params["prompt_token_ids"] = answer.prompt_token_ids
    return {**body, "kv_transfer_params": params}


def loopback_side_channel(params: dict[str, Any], prefill_url: str) -> bool:
    """P's side channel names a loopback host while P is reached at another host: vLLM's
    default ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (localhost, envs.py) left unset on a prefill
    replica, so a decode replica elsewhere pulls from itself and fails."""
    host = params.get("remote_host")
    if not isinstance(host, str) or host.lower() not in LOOPBACK_NAMES:
        return False
    target = (urlsplit(prefill_url).hostname or "").lower()
    return target not in LOOPBACK_NAMES and not target.startswith("127.")


def pulled_blocks(prompt_tokens: int, block_size: int, decode_matched_blocks: int) -> int:
    """Blocks a decode replica pulls: every block of the prompt (the last partial one too:
    vLLM's remote_block_ids name them all) past the ones it holds."""
    return max(0, -(-prompt_tokens // block_size) - decode_matched_blocks)
