"""``GET /admin/diagnostics``: the live report over HTTP."""

from __future__ import annotations

from aiohttp import web

from router.core.errors import bad_request
from router.gateway import Gateway
from router.ops.diagnose.live import attach
from router.ops.diagnose.render import render_text
from router.ops.explain import check_admin


async def handle(gateway: Gateway, request: web.Request) -> web.Response:
    """``GET /admin/diagnostics?model=&tenant=&app=&format=json|text&redact=1``."""
    check_admin(request, gateway.config.auth.admin_key, required=True)
    diag = attach(gateway)
    q = request.query
    fmt = q.get("format", "json").lower()
    if fmt not in ("json", "text"):
        raise bad_request("format must be json or text", "format")
    redact = q.get("redact", "").lower() in ("1", "true", "yes")
    rep = diag.report(
        model=q.get("model") or None,
        tenant=q.get("tenant") or None,
        app=q.get("app") or None,
        redact=redact,
    )
    if fmt == "text":
        return web.Response(text=render_text(rep), content_type="text/plain")
    return web.json_response(rep)
