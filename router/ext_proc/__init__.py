"""Endpoint picker mode: the gateway's scheduler behind an Envoy-based inference gateway
(Gateway API Inference Extension), over Envoy's ext_proc gRPC stream.

Needs the ``ext-proc`` extra (grpcio, grpcio-health-checking and Envoy's generated protos from
``xds-protos``); ``missing()`` names it when absent, so nothing else imports gRPC.
"""

from __future__ import annotations

import importlib.util

EXTRA = "ext-proc"
_MODULES = ("grpc", "grpc_health.v1", "envoy.service.ext_proc.v3")


def missing() -> str | None:
    """One line naming the extra to install, or None when ext_proc mode can run."""
    for name in _MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (
                f"--ext-proc-port needs the {EXTRA} extra (grpcio and Envoy's protos): "
                f"pip install 'prefix-router[{EXTRA}]'"
            )
    return None
