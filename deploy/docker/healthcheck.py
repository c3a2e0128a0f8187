"""The image's HEALTHCHECK: GET /health on the address the gateway listens on.

The gateway is PID 1 of the container, so the address is resolved the way the gateway resolves
its config: ``--port``/``--host``/``--config`` on its command line (/proc/1/cmdline), else
``PREFIX_ROUTER_PORT``/``PREFIX_ROUTER_HOST``/``PREFIX_ROUTER_CONFIG``, else the config file
(/etc/prefix-router/router.yaml by default), else the gateway's default port, 8000.
Standard library (plus PyYAML, to read the config file). Exit 0 when /health answers 2xx.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_CONFIG = "/etc/prefix-router/router.yaml"
DEFAULT_PORT = 8000


def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _pid1_argv() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _config_file(path: str) -> Mapping[str, Any]:
    try:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f)
    except Exception:  # missing, unreadable or invalid: the gateway would not be up anyway
        return {}
    return data if isinstance(data, dict) else {}


def target(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The /health URL for a gateway started with ``argv`` in environment ``env``."""
    path = _flag(argv, "--config") or env.get("PREFIX_ROUTER_CONFIG") or DEFAULT_CONFIG
    cfg = _config_file(path)
    port = _flag(argv, "--port") or env.get("PREFIX_ROUTER_PORT") or cfg.get("port", DEFAULT_PORT)
    host = str(_flag(argv, "--host") or env.get("PREFIX_ROUTER_HOST") or cfg.get("host", ""))
    if host in ("", "0.0.0.0", "::", "[::]", "localhost"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{int(port)}/health"


def main() -> int:
    try:
        url = target(_pid1_argv(), os.environ)
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 0 if 200 <= resp.status < 300 else 1
    except Exception as exc:  # any failure means unhealthy
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
