"""Why a request goes where it goes: the request path up to the decision, made visible.

Online, ``POST /v1/route/explain`` takes a chat or completions body and answers with what
the gateway computed for it, without forwarding. Offline, ``prefix-router explain`` prints the
token ids and block hashes for request bodies, through the very same ``Gateway.prepare``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web

from router.blocks import cacheable_blocks
from router.body import read_body
from router.config import ConfigError
from router.errors import APIError, bad_request
from router.gateway import Gateway
from router.handlers import admin_key_ok
from router.offline import offline_gateway
from router.request import Endpoint, RoutedRequest
from router.schedule import Decision
from router.usage import HelpFormatter, OneLineParser

SHOWN_HASHES = 8


def endpoint_of(body: Any, hint: str | None = None) -> Endpoint:
    if hint in ("chat", "completions", "messages", "responses"):
        return hint  # type: ignore[return-value]
    if hint not in (None, ""):
        raise bad_request("endpoint must be chat, completions, messages or responses", "endpoint")
    if isinstance(body, dict) and "messages" in body:
        # Anthropic's Messages API shares the key: ``endpoint=messages`` tells them apart.
        return "chat"
    if isinstance(body, dict) and "input" in body:
        return "responses"
    if isinstance(body, dict) and "prompt" in body:
        return "completions"
    raise bad_request("cannot tell the endpoint: the body has neither messages nor prompt")


def describe(
    rr: RoutedRequest, decision: Decision | None, *, include_tokens: bool, all_hashes: bool = False
) -> dict[str, Any]:
    """The JSON an operator reads. Never contains the salt or any secret."""
    hashes = rr.block_hashes if all_hashes else rr.block_hashes[:SHOWN_HASHES]
    out: dict[str, Any] = {
        "request_id": rr.request_id,
        "endpoint": rr.endpoint,
        "model": rr.model,
        "tenant": rr.tenant,
        "lora": rr.lora,
        "salt_policy": rr.salt_policy,
        "salted": rr.cache_salt is not None,
        "prompt_tokens": rr.num_tokens,
        "block_size": rr.block_size,
        "full_blocks": rr.num_tokens // rr.block_size,
        "cacheable_blocks": cacheable_blocks(rr.num_tokens, rr.block_size),
        "hashed_blocks": len(rr.block_hashes),
        "block_hashes": [f"{h:016x}" for h in hashes],
    }
    if include_tokens:
        out["token_ids"] = list(rr.token_ids)
    if decision is not None:
        out["policy"] = decision.policy
        out["decision"] = {
            "replica": decision.replica,
            "reason": decision.reason,
            "why": decision.why,
            "predicted_cached_blocks": decision.matched_blocks,
            "predicted_cached_tokens": decision.matched_blocks * rr.block_size,
            "ring_choice": decision.ring_choice,
            "spill_cause": decision.cause,
            "spill_copied_blocks": decision.copied_blocks,
            "prefix_replicas": decision.holders,
        }
        # Each scorer's weighted term and each filter's verdict, whatever the plugins are.
        out["candidates"] = [
            {
                "replica": s.url,
                "matched_blocks": s.matched_blocks,
                "load": s.load,
                "terms": dict(s.terms),
                "estimated_cost": s.cost,
                "filtered": s.filtered,
                "filtered_by": s.filtered_by,
                "chosen": s.url == decision.replica,
            }
            for s in decision.scores
        ]
    return out


def check_admin(request: web.Request, admin_key: str | None, *, required: bool) -> None:
    """Admin endpoints take ``X-Admin-Key``; with no admin key configured, ``required``
    endpoints are off and the others open."""
    if not admin_key:
        if required:
            raise APIError(404, "this admin endpoint is off: configure admin_key to enable it")
        return
    if not admin_key_ok(request, admin_key, accept_bearer=False):
        raise APIError(
            401, "admin endpoints need a valid X-Admin-Key header", code="invalid_admin_key"
        )


async def handle(gateway: Gateway, request: web.Request, request_id: str) -> web.Response:
    check_admin(request, gateway.config.admin_key, required=False)
    raw = await read_body(request, gateway.config.max_body_bytes)  # as the live path reads it
    try:
        peek = json.loads(raw) if raw.strip() else None
    except ValueError:
        peek = None  # prepare() reports the JSON error in the usual shape
    hint = request.query.get("endpoint") or request.headers.get("X-Prefix-Router-Endpoint")
    endpoint = endpoint_of(peek, hint) if peek is not None else "chat"
    rr = await gateway.prepare(raw, request.headers, endpoint, request_id)
    decision = await gateway.decide(rr)
    include = request.query.get("token_ids", "").lower() in ("1", "true", "yes")
    body = describe(
        rr,
        decision,
        include_tokens=include,
        all_hashes=request.query.get("all_hashes", "") in ("1", "true"),
    )
    body["schedule"] = gateway.policy.describe()  # the plugins and weights behind the terms
    if gateway.kv_events is not None:  # precise mode: is each candidate's index event-fed?
        for candidate in body.get("candidates", []):
            candidate["kv_events"] = gateway.kv_events.state(candidate["replica"])
    return web.json_response(body)


# -- offline ----------------------------------------------------------------------------------
async def _explain_lines(
    gateway: Gateway, lines: Iterable[str], headers: dict[str, str], all_hashes: bool
) -> int:
    """Print one JSON line per body; return how many lines failed."""
    failures = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            endpoint = endpoint_of(json.loads(line))
            rr = await gateway.prepare(line.encode(), headers, endpoint, f"line-{n}")
            out = describe(rr, None, include_tokens=True, all_hashes=all_hashes)
            out = {
                "line": n,
                "token_ids": out.pop("token_ids"),
                "block_hashes": out.pop("block_hashes"),
                **out,
            }
        except ValueError as e:
            out, failures = {"line": n, "error": f"not JSON: {e}"}, failures + 1
        except APIError as e:
            out, failures = {"line": n, "error": e.message, "param": e.param}, failures + 1
        print(json.dumps(out), flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(
        formatter_class=HelpFormatter,
        prog="prefix-router explain",
        description="Print, for each request body (one JSON object per line), the prompt token "
        "ids and leading block hashes the gateway computes: the same rendering, tokenization, "
        "salt policy and hashing as the live path. No replica is needed.",
    )
    p.add_argument(
        "file",
        nargs="?",
        default="-",
        help="JSON-lines file of request bodies (default: standard input)",
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or cached model id")
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (vLLM --block-size)"
    )
    p.add_argument("--config", help="gateway config file (for salt policy, tenants)")
    p.add_argument("--tenant-key", help="an API key, to explain as that tenant would be")
    p.add_argument(
        "--all-hashes", action="store_true", help=f"every block hash, not the first {SHOWN_HASHES}"
    )
    a = p.parse_args(argv)
    try:
        gateway = offline_gateway(a.tokenizer, a.block_size, a.config)
    except ConfigError as e:
        print(f"prefix-router explain: {e}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {a.tenant_key}"} if a.tenant_key else {}
    try:
        stream = sys.stdin if a.file == "-" else open(a.file, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        print(f"prefix-router explain: cannot read {a.file}: {e.strerror}", file=sys.stderr)
        return 2
    with stream:
        failures = asyncio.run(_explain_lines(gateway, stream, headers, a.all_hashes))
    return 1 if failures else 0
