"""The HTTP handlers of the Messages and Responses APIs and the forwarded endpoints,
registered on the gateway's app by ``register`` (one line in ``build_app``).

Both APIs are routed like chat (``Handlers.route``: their bodies are rendered through their
converters, router/api/convert.py, which the app hands to the request path); only the
errors' shape and the Responses store differ."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.api import anthropic
from router.api.forwarded import GET_PATHS, POST_PATHS, forward_get, forward_post
from router.api.response_ids import ResponseReplicas, response_id_in
from router.errors import APIError

if TYPE_CHECKING:
    from router.forward import Outcome
    from router.gateway import Gateway
    from router.handlers import Handlers
    from router.request import RoutedRequest
    from router.schedule import Decision


class _LearnResponseIds:
    """Observer of finished requests: remembers which replica stored each response."""

    def __init__(self, gateway: Gateway, ids: ResponseReplicas) -> None:
        self.gateway = gateway
        self.ids = ids

    def observe(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        if rr.endpoint != "responses" or outcome.status != 200 or rr.body.get("store") is False:
            return
        response_id = response_id_in(outcome.head)
        if response_id is not None:
            self.ids.remember(response_id, decision.replica)
            if self.ids.redis is not None:
                self.gateway.spawn(self.ids.share(response_id, decision.replica))


def register(app: web.Application, routes: Handlers, REQUEST_ID: web.RequestKey[str]) -> None:  # noqa: N803
    """``REQUEST_ID``: the key the gateway's middleware stores each request's id under."""
    gateway = routes.gw
    # Fleet mode's Redis client exists once the gateway has started.
    ids = ResponseReplicas(
        redis=lambda: gateway.fleet_mode.redis if gateway.fleet_mode is not None else None,
        namespace=gateway.config.redis_prefix,
    )
    gateway.watch(_LearnResponseIds(gateway, ids))

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
        rr = await routes.path.prepare(
            raw, request.headers, "responses", request_id, tenant, lazy=True
        )
        previous = rr.body.get("previous_response_id")
        if isinstance(previous, str):
            replica = await ids.lookup(previous)
            if replica is not None:  # gone or unknown: routed as usual; vLLM answers 404
                rr = dataclasses.replace(rr, pinned_replica=replica)
        return await routes.route_prepared(request, rr)

    async def post(request: web.Request) -> web.StreamResponse:
        return await forward_post(routes, request, request[REQUEST_ID])

    async def get(request: web.Request) -> web.StreamResponse:
        return await forward_get(routes, request, request[REQUEST_ID])

    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)
    for path in POST_PATHS:
        app.router.add_post(path, post)
    for path in GET_PATHS:
        app.router.add_get(path, get)


def _anthropic_error(e: APIError, request_id: str) -> web.Response:
    headers: dict[str, Any] = {"x-request-id": request_id}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return anthropic.error_response(e, headers)
