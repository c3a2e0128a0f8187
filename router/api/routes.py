"""The HTTP handlers of the Messages and Responses APIs and the forwarded endpoints,
registered on the gateway's app by ``register`` (one line in ``build_app``).

Both APIs are routed like chat (``Handlers.route``: their bodies are rendered through their
converters, router/api/convert.py, which the app hands to the request path); only the
errors' shape and the Responses store differ.

Stored responses belong to the tenant that created them (router/api/response_ids.py). With
auth on, the gateway names every stored response itself (the body's ``request_id``, which
vLLM takes as the response's id; a client's own is replaced), so no tenant can name, and so
overwrite, another's; a ``previous_response_id``, ``GET``, ``DELETE`` or ``cancel`` naming
an id this tenant did not create is answered as an unknown id is, and never forwarded."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.api import anthropic
from router.api.forwarded import GET_PATHS, POST_PATHS, forward_get, forward_post
from router.api.response_ids import ResponseReplicas, new_response_id, response_id_in
from router.core.errors import APIError, bad_request, clip
from router.intake.held import waiting
from router.routing.forwarder import PinnedJob

if TYPE_CHECKING:
    from router.fleet.replicas import Replica
    from router.gateway import Gateway
    from router.http.handlers import Handlers
    from router.intake.routed_request import RoutedRequest
    from router.schedule import Decision
    from router.upstream.proxy import Outcome


class _LearnResponseIds:
    """Observer of finished requests: remembers which replica stored each response."""

    def __init__(self, gateway: Gateway, ids: ResponseReplicas) -> None:
        self.gateway = gateway
        self.ids = ids

    def observe(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        if rr.endpoint != "responses" or outcome.status != 200 or rr.body.get("store") is False:
            return
        response_id = response_id_in(outcome.head)
        if response_id is None:
            return
        remembered = self.ids.remember(response_id, decision.replica, rr.tenant)
        if remembered and self.ids.redis is not None:
            self.gateway.spawn(self.ids.share(response_id, decision.replica, rr.tenant))


# The gateway's store of which replica holds each response, for the other front end
# (router/ext_proc/, through ``pin_stored``).
RESPONSE_IDS: web.AppKey[ResponseReplicas] = web.AppKey("response_ids")


async def pin_stored(rr: RoutedRequest, tenant: str, ids: ResponseReplicas) -> RoutedRequest:
    """``rr`` pinned to the replica holding its ``previous_response_id``, and with auth
    on, the id of the response it stores ours."""
    previous = rr.body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad_request("previous_response_id must be a string", "previous_response_id")
        replica = await ids.lookup(previous, tenant)
        if replica is not None:
            rr = dataclasses.replace(rr, pinned_replica=replica)
        elif ids.enforce:
            # Unknown here may still be held by a replica for another tenant: never sent.
            raise not_found(previous)
        # else (one tenant): routed as usual; vLLM answers 404 if it is gone
    if ids.enforce and rr.body.get("store") is not False:
        rr.body["request_id"] = new_response_id()  # the response's id: ours, not the client's
        rr = dataclasses.replace(rr, raw=None)  # the body changed: forwarded re-encoded
    return rr


def not_found(response_id: str) -> APIError:
    """vLLM's answer for an id its store does not hold; the gateway's for one the tenant
    did not create, word for word the same."""
    return APIError(
        404,
        f"Response with id '{clip(response_id)}' not found.",
        type_="invalid_request_error",
        code="response_not_found",
    )


def register(app: web.Application, routes: Handlers, REQUEST_ID: web.RequestKey[str]) -> None:  # noqa: N803
    """``REQUEST_ID``: the key the gateway's middleware stores each request's id under."""
    gateway = routes.gw
    # Fleet mode's Redis client exists once the gateway has started.
    ids = ResponseReplicas(
        redis=lambda: gateway.fleet_mode.redis if gateway.fleet_mode is not None else None,
        namespace=gateway.config.fleet.redis_prefix,
        enforce=gateway.config.auth.enabled,
    )
    gateway.watch(_LearnResponseIds(gateway, ids))
    app[RESPONSE_IDS] = ids

    async def messages(request: web.Request) -> web.StreamResponse:
        try:
            return await routes.route(request, "messages")
        except APIError as e:
            return _anthropic_error(e, request[REQUEST_ID])

    async def count_tokens(request: web.Request) -> web.StreamResponse:
        try:
            return await forward_post(routes, request, request[REQUEST_ID])
        except APIError as e:
            return _anthropic_error(e, request[REQUEST_ID])

    async def responses(request: web.Request) -> web.StreamResponse:
        request_id = request[REQUEST_ID]
        tenant = routes.identify(request)
        raw = await routes.read_body(request, tenant=tenant)
        with routes.hold(request, tenant, raw):
            rr = await routes.path.prepare(
                raw, request.headers, "responses", request_id, tenant, lazy=True, limited=True
            )
            del raw  # what waits is one copy of its body, the bytes it forwards
            rr = waiting(await pin_stored(rr, tenant, ids))
            return await routes.route_prepared(request, rr)

    async def stored(request: web.Request) -> web.StreamResponse:
        """``GET``/``DELETE /v1/responses/{id}`` and ``POST .../cancel``: to the replica
        holding the response, for the tenant that created it; anyone else gets the 404 of an
        unknown id."""
        tenant = gateway.tenancy.identify(request.headers)
        response_id = request.match_info["response_id"]
        replica = await ids.lookup(response_id, tenant)
        assert gateway.fleet is not None
        held = gateway.fleet.replicas.get(replica) if replica is not None else None
        if held is None:
            raise not_found(response_id)
        resp = await _relay(routes, request, held, request[REQUEST_ID])
        if request.method == "DELETE" and resp.status == 200:
            ids.forget(response_id)
            await ids.unshare(response_id)
        return resp

    async def post(request: web.Request) -> web.StreamResponse:
        return await forward_post(routes, request, request[REQUEST_ID])

    async def get(request: web.Request) -> web.StreamResponse:
        return await forward_get(routes, request, request[REQUEST_ID])

    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", stored)
    app.router.add_delete("/v1/responses/{response_id}", stored)
    app.router.add_post("/v1/responses/{response_id}/cancel", stored)
    for path in POST_PATHS:
        app.router.add_post(path, post)
    for path in GET_PATHS:
        app.router.add_get(path, get)


def _anthropic_error(e: APIError, request_id: str) -> web.Response:
    headers: dict[str, Any] = {"x-request-id": request_id}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return anthropic.error_response(e, headers)


async def _relay(
    routes: Handlers, request: web.Request, replica: Replica, request_id: str
) -> web.StreamResponse:
    """``request`` (no body) to ``replica`` through the one forwarding path, its answer
    relayed (``GET ...?stream=true`` replays a background response's events)."""
    headers = routes.upstream_headers(request)
    headers.popall("Content-Type", None)  # no body
    job = PinnedJob(request.path_qs, headers, request.method, replica)
    return await routes.gw.forwarder.forward(request, request_id, job)
