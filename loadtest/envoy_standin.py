"""An in-process Envoy stand-in for the endpoint picker's tests and benchmark
(loadtest/bench_ext_proc.py): a gRPC client
that plays Envoy's side of the ext_proc protocol (as llm-d's hermetic integration tests do,
test/integration/util.go) and relays the request to the endpoint the picker names itself.

Envoy's behaviour it follows (envoy source/extensions/filters/http/ext_proc/processor_state.cc,
mutation_utils.cc): request headers first (lower-case keys, pseudo-headers, values in
``raw_value``), then in FULL_DUPLEX_STREAMED the body chunks without waiting, in BUFFERED the
whole body once the headers are answered; header mutations applied (never to pseudo-headers or
``host``); the destination read from ``x-gateway-destination-endpoint``, primary first, the
next tried when a connection is refused (and, with ``retry_on``, when it answers one of those
statuses, as a route's retry policy makes Envoy do: HTTPRoute ``retry.codes``); the response headers with the served endpoint in
``envoy.lb`` metadata, then each upstream chunk as it comes; an immediate response answered to
the client as is.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from router.ext_proc import protocol

CHUNK = 16_384  # the client's body reaches Envoy in pieces of this size


@dataclass
class Answer:
    """What the client got, and what the stand-in saw on the way."""

    status: int
    headers: CIMultiDict[str]
    body: bytes
    immediate: bool = False
    pick: str = ""  # the destination header's value
    metadata_pick: str = ""  # the same in envoy.lb dynamic metadata
    served: str = ""  # the endpoint that answered
    sent_headers: CIMultiDict[str] = field(default_factory=CIMultiDict)  # to the replica
    sent_body: bytes = b""
    picked_s: float = 0.0  # request headers sent -> the pick and the whole body back
    responded_s: float = 0.0  # the replica's last byte -> the picker passed it all back
    chunks: int = 0  # response body chunks the picker passed back before the end

    def json(self) -> Any:
        import json

        return json.loads(self.body)


def _headers(pairs: CIMultiDict[str], end: bool) -> pb.HttpHeaders:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in pairs.items()
        ]
    )
    return pb.HttpHeaders(headers=hm, end_of_stream=end)


def _apply(target: CIMultiDict[str], mutation: pb.HeaderMutation) -> None:
    for key in mutation.remove_headers:
        if not key.startswith(":") and key != "host":
            target.popall(key, None)
    for opt in mutation.set_headers:
        key = opt.header.key
        if key.startswith(":") or key == "host":
            continue  # Envoy's mutation rules refuse these
        value = opt.header.raw_value.decode() if opt.header.raw_value else opt.header.value
        if opt.append_action == base_pb2.HeaderValueOption.APPEND_IF_EXISTS_OR_ADD:
            target.add(key, value)
        else:
            target[key] = value


class EnvoyStandIn:
    def __init__(
        self,
        target: str,
        mode: int = protocol.FULL_DUPLEX,
        retry_on: frozenset[int] = frozenset(),
    ) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.mode = mode
        # Statuses retried on the pick's next endpoint before anything reaches the client
        # (Envoy's retriable-status-codes, the override_host policy walking the list).
        self.retry_on = retry_on
        self.session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.channel.close()

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(auto_decompress=False)
        return self.session

    async def relay_only(self, path: str, body: bytes, endpoint: str) -> Answer:
        """The relay alone, to ``endpoint``, with no picker asked: Envoy's own part of a
        request (the benchmark's baseline for the picker's added latency)."""
        headers = {"content-type": "application/json", "x-request-id": os.urandom(8).hex()}
        async with self._session().post(
            f"http://{endpoint}{path}", data=body, headers=headers
        ) as r:
            data = await r.read()
            return Answer(r.status, CIMultiDict(r.headers), data, served=endpoint)

    async def post(
        self,
        path: str,
        body: Any,
        headers: dict[str, str] | None = None,
        subset: list[str] | str | None = None,
        mode: int | None = None,
        response_mode: int | None = None,
    ) -> Answer:
        """``body`` (JSON-encoded unless bytes) POSTed to ``path`` through the picker."""
        import json

        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        mode = self.mode if mode is None else mode
        response_mode = mode if response_mode is None else response_mode
        client = CIMultiDict(
            {
                ":method": "POST",
                ":path": path,
                ":authority": "gateway.example",
                ":scheme": "http",
                "content-type": "application/json",
                "content-length": str(len(raw)),
                "x-request-id": os.urandom(8).hex(),
                "x-forwarded-for": "10.1.2.3",
            }
        )
        client.update(headers or {})
        call = self.stub.Process()
        first = pb.ProcessingRequest(request_headers=_headers(client, not raw))
        first.protocol_config.request_body_mode = mode  # type: ignore[assignment]
        first.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
        if subset is not None:
            value = struct_pb2.Value()
            if isinstance(subset, str):
                value.string_value = subset
            else:
                value.list_value.values.extend(struct_pb2.Value(string_value=s) for s in subset)
            hint = first.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE]
            hint.fields[protocol.SUBSET].CopyFrom(value)
        start = time.perf_counter()
        await call.write(first)
        try:
            return await self._exchange(call, client, raw, path, mode, response_mode, start)
        finally:
            call.cancel()

    async def _exchange(
        self,
        call: Any,
        client: CIMultiDict[str],
        raw: bytes,
        path: str,
        mode: int,
        response_mode: int,
        start: float,
    ) -> Answer:
        pieces = [raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)]
        if mode == protocol.FULL_DUPLEX:
            for n, piece in enumerate(pieces):  # without waiting for any answer
                msg = pb.HttpBody(body=piece, end_of_stream=n == len(pieces) - 1)
                await call.write(pb.ProcessingRequest(request_body=msg))
        answer = await call.read()
        if answer.HasField("immediate_response"):
            return self._immediate(answer.immediate_response)
        assert answer.HasField("request_headers"), answer
        common = answer.request_headers.response
        _apply(client, common.header_mutation)
        metadata = answer.dynamic_metadata
        sent = raw
        if mode == protocol.BUFFERED and raw:
            await call.write(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
            )
            answer = await call.read()
            if answer.HasField("immediate_response"):
                return self._immediate(answer.immediate_response)
            assert answer.HasField("request_body"), answer
            common = answer.request_body.response
            _apply(client, common.header_mutation)
            if common.body_mutation.HasField("body") or common.body_mutation.body:
                sent = common.body_mutation.body
            if answer.HasField("dynamic_metadata"):
                metadata = answer.dynamic_metadata
        elif mode == protocol.FULL_DUPLEX and raw:
            got = []
            while True:
                answer = await call.read()
                if answer.HasField("immediate_response"):
                    return self._immediate(answer.immediate_response)
                assert answer.HasField("request_body"), answer  # never a spurious message
                streamed = answer.request_body.response.body_mutation.streamed_response
                got.append(streamed.body)
                if streamed.end_of_stream:
                    break
            sent = b"".join(got)
            client.popall("content-length", None)  # Envoy drops it in this mode
        picked = time.perf_counter() - start
        pick = client.get(protocol.DESTINATION, "")
        lb = metadata.fields[protocol.LB_NAMESPACE].struct_value.fields
        metadata_pick = lb[protocol.DESTINATION].string_value if protocol.DESTINATION in lb else ""
        return await self._relay(
            call, client, sent, path, pick, metadata_pick, picked, response_mode
        )

    def _immediate(self, ir: pb.ImmediateResponse) -> Answer:
        headers: CIMultiDict[str] = CIMultiDict()
        _apply(headers, ir.headers)
        return Answer(ir.status.code, headers, ir.body, immediate=True)

    async def _relay(
        self,
        call: Any,
        client: CIMultiDict[str],
        body: bytes,
        path: str,
        pick: str,
        metadata_pick: str,
        picked: float,
        response_mode: int,
    ) -> Answer:
        session = self._session()
        upstream = CIMultiDict(
            (k, v)
            for k, v in client.items()
            if not k.startswith(":") and k.lower() not in ("host", protocol.DESTINATION)
        )
        endpoints = [e.strip() for e in pick.split(",") if e.strip()]
        for n, endpoint in enumerate(endpoints):
            try:
                resp = await session.post(f"http://{endpoint}{path}", data=body, headers=upstream)
            except aiohttp.ClientConnectorError:
                continue  # refused: the next endpoint, as Envoy's ORIGINAL_DST retry does
            if resp.status in self.retry_on and n + 1 < len(endpoints):
                resp.release()  # retried on the next endpoint; the picker never sees it
                continue
            async with resp:
                return await self._respond(
                    call, resp, endpoint, client, body, pick, metadata_pick, picked, response_mode
                )
        await call.done_writing()
        return Answer(503, CIMultiDict(), b"no healthy upstream", pick=pick)

    async def _respond(
        self,
        call: Any,
        resp: aiohttp.ClientResponse,
        endpoint: str,
        sent_headers: CIMultiDict[str],
        sent_body: bytes,
        pick: str,
        metadata_pick: str,
        picked: float,
        response_mode: int,
    ) -> Answer:
        headers = CIMultiDict({":status": str(resp.status)})
        for k, v in resp.headers.items():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                headers.add(k.lower(), v)
        msg = pb.ProcessingRequest(response_headers=_headers(headers, False))
        served = msg.metadata_context.filter_metadata[protocol.LB_NAMESPACE]
        served.fields[protocol.SERVED].string_value = endpoint
        await call.write(msg)
        out = bytearray()
        chunks = 0
        done_at = 0.0
        if response_mode == protocol.FULL_DUPLEX:
            # Envoy sends the body as it comes without waiting for the headers' answer; the
            # answers are read as they come back, the headers' first.

            async def collect() -> None:
                nonlocal chunks
                a = await call.read()
                assert a.HasField("response_headers"), a
                _apply(headers, a.response_headers.response.header_mutation)
                while True:
                    a = await call.read()
                    assert a.HasField("response_body"), a
                    streamed = a.response_body.response.body_mutation.streamed_response
                    out.extend(streamed.body)
                    chunks += 1
                    if streamed.end_of_stream:
                        return

            reader = asyncio.create_task(collect())
            try:
                # With a Content-Length, the last chunk carries the end (as Envoy's HTTP/1
                # codec reports it); a chunked body ends with an empty one.
                left = resp.content_length
                async for chunk in resp.content.iter_any():
                    if left is not None:
                        left -= len(chunk)
                    end = left is not None and left <= 0
                    if end:
                        done_at = time.perf_counter()
                    await call.write(
                        pb.ProcessingRequest(
                            response_body=pb.HttpBody(body=chunk, end_of_stream=end)
                        )
                    )
                    if end:
                        break
                else:
                    done_at = time.perf_counter()
                    await call.write(
                        pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))
                    )
                await reader
            finally:
                reader.cancel()
        else:
            answer = await call.read()
            assert answer.HasField("response_headers"), answer
            _apply(headers, answer.response_headers.response.header_mutation)
            data = await resp.read()
            done_at = time.perf_counter()
            await call.write(
                pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=True))
            )
            a = await call.read()
            mutation = a.response_body.response.body_mutation
            out.extend(mutation.body if mutation.body else data)
            chunks = 1
        responded = time.perf_counter() - done_at
        await call.done_writing()
        headers.popall(":status", None)
        return Answer(
            resp.status,
            headers,
            bytes(out),
            pick=pick,
            metadata_pick=metadata_pick,
            served=endpoint,
            sent_headers=sent_headers,
            sent_body=sent_body,
            picked_s=picked,
            responded_s=responded,
            chunks=chunks,
        )
