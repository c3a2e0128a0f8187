"""vLLM endpoints the gateway forwards without routing on a prompt: to the least-loaded
healthy replica serving the body's model, with auth, a request id, and retries on another
replica before the first byte. JSON bodies, and multipart ones (audio uploads) as sent.

Each counts against its tenant's rate limits as a generation request does: rpm before its
body is read, tpm on an estimate of its input (its text over ``CHARS_PER_TOKEN``, token ids
one each: router/intake/costs.py; nothing renders it here). Those that run the model on a prompt
(``QUEUED_PATHS``: pooling, scoring, reranking) also take a prefill slot of the body's model
from flow control, waiting in their tenant's flow while its replicas are saturated."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.core.errors import APIError, bad_request
from router.fleet.replicas import Fleet
from router.flow.ticket import Ticket
from router.intake import costs
from router.intake.body import decode_body
from router.intake.parse import forwarded_bytes
from router.models.fallback import CHARS_PER_TOKEN
from router.routing.accounting import Attempt
from router.routing.forwarder import Job, least_loaded

if TYPE_CHECKING:
    from router.http.handlers import Handlers

# POST routes vLLM 0.34.0 serves beside the routed ones (vllm/entrypoints/.../api_router.py).
POST_PATHS = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/v1/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/chat/completions/render",
    "/v1/completions/render",
)
GET_PATHS = ("/version",)
# The ones that run the model on their input: a prefill slot from flow control.
QUEUED_PATHS = frozenset(
    p for p in POST_PATHS if not p.startswith("/v1/audio/") and not p.endswith("/render")
)
MULTIPART = "multipart/form-data"


async def _model_of(handlers: Handlers, raw: bytes, content_type: str) -> tuple[str | None, Any]:
    """The body's model, and the parsed body (None for an upload). A large body is parsed in
    a worker thread, a costly one in pieces (``RequestPath.parse_json``): on the event loop
    a body of 1M values held it 50-85 ms."""
    if content_type.startswith(MULTIPART):
        return None, None  # an upload: any replica serving the base model takes it
    body = await handlers.path.parse_json(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model, body


async def _read(handlers: Handlers, request: web.Request, tenant: str) -> tuple[bytes, str]:
    content_type = request.headers.get("Content-Type", "").strip().lower()
    if content_type.startswith(MULTIPART):
        # Forwarded as sent (its boundary is in the header), within the same bounds.
        # Content-Encoding is never forwarded, so a compressed upload is forwarded decoded
        # (it went out still compressed and labelled plain), within max_body_bytes.
        raw = await handlers.read_body(request, tenant=tenant, as_sent=True)
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity"):
            if coding not in ("gzip", "x-gzip", "deflate"):
                raise APIError(
                    415,
                    f"Content-Encoding {coding[:50]!r} is not supported; send the body as is, "
                    "gzip or deflate",
                    code="unsupported_content_encoding",
                )
            raw = await decode_body(coding, raw, handlers.gw.config.limits.max_body_bytes)
        return raw, request.headers["Content-Type"]
    return await handlers.read_body(request, tenant=tenant), "application/json"


class _Forwarded(Job):
    """A forwarded request: to the least-loaded replica serving the body's model (any
    healthy one for an upload, which names none)."""

    def __init__(
        self,
        handlers: Handlers,
        path: str,
        raw: bytes,
        headers: Any,
        model: str | None,
        ticket: Ticket,
    ) -> None:
        super().__init__(path, raw, headers)
        self.handlers = handlers
        self.model = model
        self.ticket = ticket

    async def pick(self, fleet: Fleet, tried: frozenset[str]) -> Attempt | None:
        if self.model is None:
            return await super().pick(fleet, tried)
        serving = self.handlers.path.serving(self.model, tried)
        # Where flow control reserved its slot, if that replica can take it.
        slot = next((r for r in serving if r.url == self.ticket.replica), None)
        replica = slot or least_loaded(serving)
        return Attempt(replica) if replica is not None else None

    def extra_headers(self, attempt: Attempt) -> dict[str, str]:
        return dict(self.ticket.headers)  # the tenant's rate-limit headers


def input_tokens(body: Any) -> int:
    """A forwarded body's input, estimated: its text at ``CHARS_PER_TOKEN``, token ids one
    each (an upload: 0, its audio is not counted)."""
    return costs.prompt_floor(body, CHARS_PER_TOKEN) if isinstance(body, dict) else 0


async def forward_post(
    handlers: Handlers, request: web.Request, request_id: str
) -> web.StreamResponse:
    gateway = handlers.gw
    tenant = handlers.identify(request)
    # Over its rpm: refused before a byte of its body is read.
    handlers.path.flow.precheck(tenant, gateway.tenancy.policy_of(tenant).flow)
    raw, content_type = await _read(handlers, request, tenant)
    with handlers.hold(request, tenant, raw):
        model, body = await _model_of(handlers, raw, content_type.lower())
        # The tenant's allow-lists (router/tenancy/tenants.py), as for generation requests.
        if body is not None:
            handlers.path.tenancy.check_fields(tenant, body)
        handlers.path.check_model(tenant, model)
        if model is not None and gateway.models.alias(model) != model:
            # An alias (router/models/): the replicas know the served name only.
            model = gateway.models.alias(model)
            served = {**body, "model": model}
            raw = forwarded_bytes(raw, body, served) or json.dumps(served).encode()
        tokens = input_tokens(body)
        del body  # what waits and is forwarded is its bytes, one copy
        queued = request.path in QUEUED_PATHS
        ticket = await handlers.path.admit_forwarded(tenant, model, tokens, queued)
        try:
            headers = handlers.upstream_headers(request)
            headers["Content-Type"] = content_type
            job = _Forwarded(handlers, request.path_qs, raw, headers, model, ticket)
            return await gateway.forwarder.forward(request, request_id, job)
        finally:
            ticket.done()  # its prefill slot back, however it ended


async def forward_get(
    handlers: Handlers, request: web.Request, request_id: str
) -> web.StreamResponse:
    """``/version`` and the like: the least-loaded healthy replica's answer, as vLLM gives it."""
    handlers.identify(request)
    headers = handlers.upstream_headers(request)
    headers.popall("Content-Type", None)  # no body
    job = Job(request.path_qs, b"", headers, method="GET")
    return await handlers.gw.forwarder.forward(request, request_id, job)
