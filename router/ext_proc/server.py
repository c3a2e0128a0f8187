"""The ext_proc port: the endpoint picker (router/ext_proc/picker.py) and gRPC health, in the
gateway's event loop, on the same gateway objects as the HTTP port.

Health answers what Envoy's and Kubernetes' gRPC checks ask: ``liveness`` (and the empty
service name) SERVING while the process runs; ``readiness`` and the ext_proc service name
SERVING exactly when the gateway is ready as router/readiness.py defines it (read at each
check, nothing cached).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.ext_proc import protocol
from router.ext_proc.picker import Picker
from router.gateway import Gateway
from router.intake.routed_request import RoutedRequest

LIVE = frozenset({"", "liveness"})
READY = frozenset({"readiness", protocol.SERVICE_NAME})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802
        if request.service in LIVE:
            return health_pb2.HealthCheckResponse(status=SERVING)
        if request.service in READY:
            ready = self.gw.fleet is not None and self.gw.readiness().ready
            return health_pb2.HealthCheckResponse(status=SERVING if ready else NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:100]!r}")
        raise AssertionError("unreachable")  # abort raises


class ExtProcServer:
    """A started ext_proc listener (``port``: the one bound)."""

    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self.server = server
        self.port = port

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)


async def start_ext_proc(
    gateway: Gateway,
    host: str,
    port: int,
    default_mode: int = protocol.FULL_DUPLEX,
    responses: Callable[[RoutedRequest, str], Awaitable[RoutedRequest]] | None = None,
) -> ExtProcServer:
    """Serve the picker and health on ``host:port`` (``port`` 0: a free one). ``responses``:
    the Responses store's pinning (router/api/routes.py ``pin_stored``)."""
    server = grpc.aio.server()
    picker = Picker(gateway, default_mode, responses)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_pb2_grpc.add_HealthServicer_to_server(Health(gateway), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot listen for ext_proc on {address}")
    await server.start()
    return ExtProcServer(server, bound)
