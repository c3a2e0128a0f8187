"""Why a request goes where it goes: the request path up to the decision, made visible.

Online, ``POST /v1/route/explain`` takes a chat or completions body and answers with what
the gateway computed for it, without forwarding. Offline, ``prefix-router explain`` prints the
token ids and block hashes for request bodies, through the very same ``RequestPath.prepare``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web

from router.config import ConfigError
from router.core.blocks import cacheable_blocks
from router.core.errors import APIError, bad_request
from router.disagg.decision import Thresholds
from router.gateway import Gateway
from router.http.handlers import Handlers, admin_key_ok
from router.intake.budget import in_networks
from router.intake.routed_request import Endpoint, RoutedRequest
from router.ops.command_line import HelpFormatter, OneLineParser
from router.ops.offline import open_offline
from router.routing.plan import Plan
from router.schedule import Decision

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
    entry = rr.model_entry
    if entry is not None:
        # How this model's requests are matched: "tokens" (its own tokenizer), or
        # "text_prefix" (no tokenizer found: an approximation, router/models/fallback.py).
        out["model_match"] = {
            "basis": entry.basis,
            "served_model": entry.name,
            "tokenizer_origin": entry.tokenizer_origin,
            "tokenizer": entry.tokenizer,
            "missing_tokenizer": entry.missing,
            "block_size_origin": entry.block_size_origin,
            "replicas": list(entry.replicas),
            "kept_apart": list(entry.apart),
            "drift": entry.drift.state(),
            "parity": entry.parity,
            "parity_detail": entry.parity_detail,
        }
    if include_tokens:
        out["token_ids"] = list(rr.token_ids)
    if rr.adapter_load:
        out["adapter_load"] = dict(rr.adapter_load)  # loaded on the replica first
    if decision is not None:
        out["policy"] = decision.policy
        out["decision"] = {
            "replica": decision.replica,
            "reason": decision.reason,
            "why": decision.why,
            # The three reuse numbers (router/routing/reuse.py) as far as a decision knows
            # them: delivered is the replica's usage.prompt_tokens_details.cached_tokens.
            "reuse": {
                "available_tokens": max(
                    [decision.matched_blocks, *(s.matched_blocks for s in decision.scores)]
                )
                * rr.block_size,
                "captured_tokens": decision.matched_blocks * rr.block_size,
                "delivered_tokens": None,
            },
            "predicted_cached_blocks": decision.matched_blocks,
            "predicted_cached_tokens": decision.matched_blocks * rr.block_size,
            # Of those, the blocks the replica loads from an offload tier (precise mode).
            "predicted_offloaded_blocks": decision.offloaded_blocks,
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
                # Where they are: the GPU's leading run, then an offload tier's (scored at
                # kv_events_offload_weight each: "weighted_blocks").
                "tiers": {
                    "gpu": s.matched_blocks - s.offloaded_blocks,
                    "offload": s.offloaded_blocks,
                },
                "weighted_blocks": s.weighted_blocks,
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


def check_admin(
    request: web.Request,
    admin_key: str | None,
    *,
    required: bool,
    networks: Sequence[str] = (),
) -> None:
    """Admin endpoints take ``X-Admin-Key``. With no admin key configured, ``required``
    endpoints are off (404) and the others answer only peers in ``networks`` (403)."""
    if not admin_key:
        if required:
            raise APIError(404, "this admin endpoint is off: configure admin_key to enable it")
        if not in_networks(request.remote, list(networks)):
            raise APIError(
                403,
                "with no admin_key configured, this admin endpoint answers only clients from "
                "admin_networks (loopback by default): configure admin_key to use it from here",
                code="admin_only",
            )
        return
    if not admin_key_ok(request, admin_key, accept_bearer=False):
        raise APIError(
            401, "admin endpoints need a valid X-Admin-Key header", code="invalid_admin_key"
        )


async def handle(handlers: Handlers, request: web.Request, request_id: str) -> web.Response:
    """Admin check, then the tenant's key, then the body through the gateway's one bounded
    reader: nothing of the body is read (or inflated, or parsed) for a refused caller."""
    gateway = handlers.gw
    config = gateway.config
    check_admin(request, config.auth.admin_key, required=False, networks=config.auth.admin_networks)
    tenant = handlers.identify(request)
    raw = await handlers.read_body(request, tenant=tenant)  # as the live path reads it
    hint = request.query.get("endpoint") or request.headers.get("X-Prefix-Router-Endpoint")
    endpoint = endpoint_of(None, hint) if hint else await _endpoint_of_body(gateway, raw)
    rr = await gateway.path.prepare(raw, request.headers, endpoint, request_id, tenant)
    plan = await gateway.path.plan(rr)
    decision = plan.last.decision  # the replica whose answer the client gets
    include = request.query.get("token_ids", "").lower() in ("1", "true", "yes")
    body = describe(
        rr,
        decision,
        include_tokens=include,
        all_hashes=request.query.get("all_hashes", "") in ("1", "true"),
    )
    body["schedule"] = gateway.policy.describe()  # the plugins and weights behind the terms
    if gateway.path.disaggregated:  # both legs, and why there is or is not a prefill leg
        body["disaggregation"] = explain_plan(plan, gateway.path.thresholds)
    # Flow control: whether a request like this would wait now, and why.
    body["flow"] = gateway.flow.explain(
        gateway.path.flow_model(rr), rr.tenant, gateway.tenancy.policy_of(rr.tenant).flow
    )
    if gateway.kv_events is not None:  # precise mode: is each candidate's index event-fed?
        for candidate in body.get("candidates", []):
            candidate["kv_events"] = gateway.kv_events.state(candidate["replica"])
    return web.json_response(body)


def explain_plan(plan: Plan, thresholds: Thresholds) -> dict[str, Any]:
    """A disaggregated fleet's plan: each leg, and why the prefill leg was skipped if it was."""
    return {
        "prefill_leg": len(plan.legs) > 1,
        "skipped": plan.skipped,
        "decode_chosen_after_prefill": plan.decode_after_prefill,
        "thresholds": dataclasses.asdict(thresholds),
        "legs": [
            {
                "role": leg.role,
                "replica": leg.replica.url,
                "matched_blocks": leg.decision.matched_blocks,
                "prefill_tokens": leg.prefill_tokens,
            }
            for leg in plan.legs
        ],
    }


async def _endpoint_of_body(gateway: Gateway, raw: bytes) -> Endpoint:
    """The endpoint a body's keys name (a large body is parsed as prepare parses it)."""
    try:
        peek = await gateway.path.parse_json(raw) if raw.strip() else None
    except APIError:
        peek = None  # prepare() reports the JSON error in the usual shape
    return endpoint_of(peek) if peek is not None else "chat"


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
            rr = await gateway.path.prepare(line.encode(), headers, endpoint, f"line-{n}")
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
    p.add_argument(
        "--tokenizer",
        help="tokenizer directory or model id (default: the model the first body names, as "
        "serve finds it: a bundled tokenizer, else the local Hugging Face cache)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (vLLM --block-size)"
    )
    p.add_argument("--config", help="gateway config file (for salt policy, tenants)")
    p.add_argument("--tenant-key", help="an API key, to explain as that tenant would be")
    p.add_argument(
        "--all-hashes", action="store_true", help=f"every block hash, not the first {SHOWN_HASHES}"
    )
    a = p.parse_args(argv)
    opened = open_offline("explain", a)
    if opened is None:
        return 2
    gateway, lines = opened
    headers = {"Authorization": f"Bearer {a.tenant_key}"} if a.tenant_key else {}
    try:
        failures = asyncio.run(_explain_lines(gateway, lines, headers, a.all_hashes))
    except ConfigError as e:  # the file could not be read to its end
        print(f"prefix-router explain: {e}", file=sys.stderr)
        return 2
    return 1 if failures else 0
