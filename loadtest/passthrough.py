"""The floor under any gateway built like prefix-router: aiohttp in front, the gateway's own
keep-alive client (``router.upstream.client``) behind, and nothing in between (no parse, no
tokenizing, no routing: round robin over the replicas). ``bench_overhead`` runs it beside the
gateway, so the table shows how much of the gateway's cost is its routing and how much is
the Python HTTP path itself.

    python -m loadtest.passthrough --port 8100 --replica http://127.0.0.1:9001 ...
"""

from __future__ import annotations

import argparse
import itertools
import sys

from aiohttp import web

from router.upstream.client import UpstreamPool

FORWARDED = ("Content-Type", "Authorization")


def make_app(replicas: list[str]) -> web.Application:
    pool = UpstreamPool(connect_timeout=5.0, read_timeout=60.0)
    turn = itertools.cycle(replicas)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
        upstream = await pool.post(next(turn) + request.path, body, headers)
        data = await upstream.read()
        out = {"Content-Type": upstream.header("content-type", "application/json")}
        return web.Response(status=upstream.status, body=data, headers=out)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/{endpoint:.*}", forward)
    app.on_cleanup.append(lambda _: _close(pool))
    return app


async def _close(pool: UpstreamPool) -> None:
    pool.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replica", action="append", required=True, help="a replica's base URL")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # the gateway runs on uvloop when it is there: so does its floor
        pass
    web.run_app(make_app(a.replica), host=a.host, port=a.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
