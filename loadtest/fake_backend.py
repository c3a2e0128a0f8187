"""Instant fake vLLM backends for overhead benchmarks: canned answers, no tokenizing, so
only the router's own cost shows. Run: ``python -m loadtest.fake_backend --ports 9001,9002``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

MODEL = "Qwen/Qwen3-0.6B"
CHAT = json.dumps(
    {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "total_tokens": 2,
        },
    }
).encode()
COMPLETION = json.dumps(
    {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'
)
METRICS = (
    f'vllm:num_requests_running{{model_name="{MODEL}",engine="0"}} 0.0\n'
    f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="0"}} 0.0\n'
    f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="65536",engine="0"}} 1.0\n'
)
MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": MODEL,
                "parent": None,
            }
        ],
    }
)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream": true' in body or b'"stream":true' in body:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM)
        await resp.write_eof()
        return resp
    return web.Response(body=CHAT, content_type="application/json")


async def completions(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=COMPLETION, content_type="application/json")


def build_app(served_by: str = "") -> web.Application:
    """``served_by`` (``host:port``) is echoed in ``x-served-by`` with the destination the
    request came with (``x-gateway-destination-endpoint``, from an endpoint picker through
    Envoy), so a benchmark can check that a pick was honoured."""
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def echo(request: web.Request, resp: web.StreamResponse) -> None:
        resp.headers["x-served-by"] = served_by
        picked = request.headers.get("x-gateway-destination-endpoint")
        if picked is not None:
            resp.headers["x-picked"] = picked

    app.on_response_prepare.append(echo)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get(
        "/v1/models", lambda r: web.Response(text=MODELS, content_type="application/json")
    )
    app.router.add_get("/health", lambda r: web.Response(text=""))
    app.router.add_get("/metrics", lambda r: web.Response(text=METRICS))
    return app


async def serve(ports: list[int], host: str) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(build_app(f"{host}:{port}"), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        print(f"ready http://{host}:{port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ports", required=True, help="comma-separated ports")
    p.add_argument("--host", default="127.0.0.1")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve([int(x) for x in a.ports.split(",")], a.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
