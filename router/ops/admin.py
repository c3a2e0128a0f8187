"""The admin extension of the served app: ``POST /v1/route/explain`` and
``GET /admin/diagnostics``, and, with an admin key, the diagnostics observer watching every
request. The gateway layer (router/http/app.py) knows nothing of them: whoever builds the served
app passes ``install_admin`` in ``build_app``'s / ``start_gateway``'s ``extensions``.

Without an admin key, diagnostics are off (404) and explain answers only clients from
``admin_networks`` (loopback by default); explain reads its body through the gateway's one
bounded reader (``Handlers.read_body``), after the admin check and the tenant's key."""

from __future__ import annotations

from aiohttp import web

from router.gateway import Gateway
from router.http.handlers import HANDLERS, REQUEST_ID
from router.ops import diagnose, explain
from router.ops.diagnose.live import attach


def install_admin(app: web.Application, gateway: Gateway) -> None:
    if gateway.config.auth.admin_key:
        attach(gateway)  # from the first request on, not from the first report

    handlers = app[HANDLERS]

    async def explain_endpoint(request: web.Request) -> web.Response:
        return await explain.handle(handlers, request, request[REQUEST_ID])

    async def diagnostics_endpoint(request: web.Request) -> web.Response:
        return await diagnose.handle(gateway, request)

    app.router.add_post("/v1/route/explain", explain_endpoint)
    app.router.add_get("/admin/diagnostics", diagnostics_endpoint)


# What the served app (``prefix-router serve``, tests, load tests) installs on top of the core.
SERVED_EXTENSIONS = (install_admin,)
