"""The aiohttp application: middleware, routes, lifecycle hooks, and starting a gateway in a
running event loop.

    build_app -> Gateway (router/gateway.py) + Handlers (router/http/handlers.py) + extensions

Ops modules above this layer (router/ops/admin.py) add their routes through ``extensions``; this
module names none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.api import routes as api_routes
from router.api.convert import CONVERTERS
from router.api.paths import wrong_base_path
from router.config import Config
from router.core.errors import APIError
from router.gateway import Gateway
from router.http import startup
from router.http.connections import ConnectionLimits, GatewayRunner
from router.http.handlers import HANDLERS, REQUEST_ID, Handlers
from router.index import PrefixIndex
from router.intake.budget import share_of
from router.intake.routed_request import RoutedRequest
from router.prompt import Renderer
from router.telemetry.redact import install as install_redaction

log = logging.getLogger("prefix_router")

LINGER_S = 1.0  # how long an unread body is drained before its connection closes
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
# The ext_proc listener (router/ext_proc/server.py), when ``ext_proc_port`` is set.
EXT_PROC_KEY: web.AppKey[list[Any]] = web.AppKey("ext_proc")

__all__ = [
    "GATEWAY_KEY",
    "REQUEST_ID",
    "Gateway",
    "RunningGateway",
    "build_app",
    "make_runner",
    "run_app",
    "start_gateway",
]


# -- middleware ---------------------------------------------------------------------------
def new_request_id() -> str:
    """24 random hex digits: unique, and telling nothing (a counter let one tenant count
    another's requests)."""
    return os.urandom(12).hex()


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id") or new_request_id()
    if len(request_id) > 128 or not request_id.isprintable():
        request_id = new_request_id()
    request[REQUEST_ID] = request_id
    rid = {"x-request-id": request_id}
    try:
        resp = await handler(request)
    except APIError as e:
        if e.status == 401:
            rid["WWW-Authenticate"] = "Bearer"
        return e.response(rid)
    except web.HTTPRequestEntityTooLarge as e:
        return APIError(413, f"request body too large: {e.text}").response(rid)
    except web.HTTPException as e:
        if e.status == 404:
            wrong = wrong_base_path(request, rid)
            if wrong is not None:
                return wrong
        if e.status >= 400:
            return APIError(e.status, e.reason or "error").response(rid)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        # One line at the default level: a hostile body must not write a 3,000-line
        # traceback (a RecursionError's) to the log; the bounded traceback is for debug.
        log.error("request %s failed: %s: %.200s", request_id, type(e).__name__, e)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("".join(traceback.format_exception(e, limit=-12)))
        return APIError(500, "internal error in the gateway", code="internal_error").response(rid)
    if not resp.prepared:
        resp.headers.setdefault("x-request-id", request_id)
    return resp


# Adds routes or observers to the app a layer above this one (router/ops/admin.py): the gateway
# names none of them, so nothing here imports the ops modules.
Extension = Callable[[web.Application, "Gateway"], None]


def build_app(
    config: Config,
    renderer: Renderer | None = None,
    index: PrefixIndex | None = None,
    extensions: Sequence[Extension] = (),
) -> web.Application:
    install_redaction()
    gateway = Gateway(config, renderer, index, CONVERTERS)
    routes = Handlers(gateway)
    app = web.Application(
        middlewares=[errors_middleware],
        client_max_size=config.limits.max_body_bytes,
        # A body refused unread (no key, too slow, over budget) is drained for at most this
        # long, so the client can read its answer, then the connection closes (aiohttp's 10 s
        # default let refused uploads hold connections).
        handler_args={"lingering_time": LINGER_S},
    )
    app[GATEWAY_KEY] = gateway
    app[HANDLERS] = routes  # the ops routes read bodies through the same bounded reader
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/tokenize", routes.passthrough)
    app.router.add_post("/detokenize", routes.passthrough)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.prometheus)
    api_routes.register(app, routes, REQUEST_ID)  # Messages, Responses, forwarded endpoints
    for extend in extensions:
        extend(app, gateway)

    metrics_runner: list[web.AppRunner] = []
    ext_proc: list[Any] = []
    app[EXT_PROC_KEY] = ext_proc

    async def on_startup(app: web.Application) -> None:
        await gateway.start()
        if config.server.metrics_port:
            metrics_runner.append(await _start_metrics_listener(routes, config))
        if config.server.ext_proc_port is not None:
            # Imported here: gRPC and Envoy's protos are an extra only this mode needs.
            from router.ext_proc.server import start_ext_proc

            ids = app[api_routes.RESPONSE_IDS]

            async def pin(rr: RoutedRequest, tenant: str) -> RoutedRequest:
                return await api_routes.pin_stored(rr, tenant, ids)

            ext_proc.append(
                await start_ext_proc(
                    gateway, config.server.host, config.server.ext_proc_port, responses=pin
                )
            )

    async def on_shutdown(app: web.Application) -> None:
        gateway.draining = True

    async def on_cleanup(app: web.Application) -> None:
        for runner in metrics_runner:
            await runner.cleanup()
        for server in ext_proc:  # its streams finish within the same grace as HTTP's
            await server.stop(config.server.shutdown_grace_s)
        await gateway.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def _start_metrics_listener(routes: Handlers, config: Config) -> web.AppRunner:
    """A scrape-only listener: /metrics without a key, for a port only Prometheus reaches."""
    app = web.Application()
    app.router.add_get("/metrics", routes.prometheus_unauthenticated)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(
        runner, config.server.host, config.server.metrics_port, reuse_port=config.server.workers > 1
    )
    await site.start()
    return runner


@dataclass
class RunningGateway:
    url: str
    runner: web.AppRunner
    gateway: Gateway
    ext_proc_port: int | None = None  # the bound ext_proc port, when serving it

    async def stop(self) -> None:
        await self.runner.cleanup()


def make_runner(app: web.Application, config: Config, **kwargs: Any) -> GatewayRunner:
    """The app's runner with the connection limits (router/http/connections.py) of ``config``."""
    limits = ConnectionLimits(
        max_connections=config.limits.max_connections,
        header_timeout_s=config.limits.header_timeout_s,
        keepalive_timeout_s=config.limits.keepalive_timeout_s,
        max_connections_per_peer=share_of(
            config.limits.max_connections, config.limits.client_share
        ),
        unauthenticated_keepalive_s=config.limits.unauthenticated_keepalive_s,
        peer_refusals_per_s=config.limits.peer_refusals_per_s,
    )
    gateway = app.get(GATEWAY_KEY)

    def refused(reason: str) -> None:
        if gateway is not None:
            gateway.metrics.rejected.labels(reason).inc()

    return GatewayRunner(
        app,
        limits,
        refused,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.server.shutdown_grace_s,
        auto_decompress=False,  # router/intake/body.py decodes request bodies, bounded
        **kwargs,
    )


async def start_gateway(
    config: Config,
    renderer: Renderer | None = None,
    index: PrefixIndex | None = None,
    port: int | None = None,
    extensions: Sequence[Extension] = (),
) -> RunningGateway:
    """Start a gateway in this event loop (tests, demo, load tests). ``port=0`` picks one."""
    app = build_app(config, renderer, index, extensions)
    runner = make_runner(app, config)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port if port is None else port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    host, bound = sock.getsockname()[:2]
    url = f"http://{host}:{bound}"
    startup.announce(app[GATEWAY_KEY], url, ext_proc_port(app))
    return RunningGateway(url, runner, app[GATEWAY_KEY], ext_proc_port(app))


def ext_proc_port(app: web.Application) -> int | None:
    """The port the app's ext_proc listener bound, if it serves one."""
    servers = app[EXT_PROC_KEY]
    return servers[0].port if servers else None


SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval for a served gateway (the default: 5 ms)


def run_app(app: web.Application, config: Config, loop: asyncio.AbstractEventLoop) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (``prefix-router serve``): aiohttp's ``run_app``
    with this module's runner, so the connection limits hold there too."""

    async def serve() -> None:
        runner = make_runner(app, config, handle_signals=True)
        await runner.setup()
        try:
            site = web.TCPSite(
                runner, config.server.host, config.server.port, reuse_port=config.server.workers > 1
            )
            await site.start()
            url = f"http://{config.server.host}:{config.server.port}"
            startup.announce(app[GATEWAY_KEY], url, ext_proc_port(app))
            await asyncio.Event().wait()  # until a signal raises GracefulExit
        finally:
            await runner.cleanup()

    # A worker thread running Python (parsing a large body in pieces, rendering, hashing)
    # keeps the GIL until the switch interval ends each time the event loop asks for it
    # back, and answering one request asks several times (every socket call releases it):
    # behind such a thread the loop's stalls over 5 ms added up to half as much at 1 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    main = loop.create_task(serve())
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
