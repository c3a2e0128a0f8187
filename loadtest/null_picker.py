"""A do-nothing ext_proc processor: the endpoint picker's conversation with Envoy, message for
message, and no decision in it. loadtest/bench_ext_proc.py runs the Envoy stand-in against it
to measure what the gRPC conversation itself costs (the stand-in's Python client and the
runtime, grpc.aio on uvloop as the gateway serves it), so that the picker's figure can be read
net of it. Run: ``python -m loadtest.null_picker --port 9002 --endpoints 127.0.0.1:9001,...``.

It answers as router/ext_proc/transport.py does: in FULL_DUPLEX_STREAMED mode the request
headers once the body has ended (the next endpoint, round robin, as the destination header
and in ``envoy.lb`` metadata), the body back in full, the response headers, and each response
chunk passed back as it comes; in BUFFERED mode "go on" to the headers and the pick in the
body's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from router.ext_proc import protocol


class NullPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: list[str]) -> None:
        self.next: Iterator[str] = itertools.cycle(endpoints)

    def pick(self) -> tuple[Any, Any]:
        """The next endpoint as the destination header and ``envoy.lb`` metadata."""
        endpoint = next(self.next)
        return protocol.mutation({protocol.DESTINATION: endpoint}), protocol.pick_metadata(endpoint)

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        body: list[bytes] = []
        buffered = False
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            if msg.HasField("request_headers"):
                modes = protocol.body_modes(msg, protocol.FULL_DUPLEX)
                buffered = modes[0] == protocol.BUFFERED
                if buffered:
                    await context.write(protocol.request_headers_response())
            elif msg.HasField("request_body"):
                body.append(msg.request_body.body)
                if not msg.request_body.end_of_stream:
                    continue
                headers, metadata = self.pick()
                if buffered:
                    await context.write(protocol.buffered_body_response(headers, metadata, None))
                    continue
                await context.write(protocol.request_headers_response(headers, metadata))
                for chunk in protocol.streamed_chunks(b"".join(body), end=True):
                    await context.write(chunk)
            elif msg.HasField("response_headers"):
                await context.write(protocol.response_headers_response({}))
            elif msg.HasField("response_body"):
                part = msg.response_body
                if buffered:
                    await context.write(protocol.response_body_response())
                    continue
                for chunk in protocol.streamed_chunks(part.body, part.end_of_stream, True):
                    await context.write(chunk)


async def serve(port: int, endpoints: list[str]) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullPicker(endpoints), server)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    print(f"null picker on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadtest.null_picker", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--endpoints", required=True, help="host:port,... to pick in turn")
    args = p.parse_args(argv)
    try:
        import uvloop  # as the gateway runs its loop (router/cli.py)

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with contextlib.suppress(KeyboardInterrupt):  # stopped by SIGINT (loadtest/procs.py)
        loop.run_until_complete(serve(args.port, [e for e in args.endpoints.split(",") if e]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
