"""Envoy's ext_proc messages as the endpoint picker protocol uses them (GIE's protocol v1.0.0,
as GIE's and llm-d's pickers answer Envoy): reading headers and metadata, and building the
answers. Nothing here decides anything; router/ext_proc/stream.py runs the conversation.

Envoy's generated classes come from the ``xds-protos`` package (the ``ext-proc`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse

DESTINATION = "x-gateway-destination-endpoint"  # the pick: "host:port[,host:port...]"
SERVED = "x-gateway-destination-endpoint-served"  # which of them Envoy reached
SUBSET = "x-gateway-destination-endpoint-subset"  # the endpoints a request may go to
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# Envoy refuses chunks past 64 KiB in some builds; llm-d cuts at 62,000 bytes
# (llm-d-router pkg/common/envoy/chunking.go, BodyByteLimit).
CHUNK_BYTES = 62_000

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: pb.HttpHeaders) -> CIMultiDict[str]:
    """Envoy's headers (values in ``raw_value``, older builds in ``value``) as a
    case-insensitive multidict, pseudo-headers included."""
    out: CIMultiDict[str] = CIMultiDict()
    for h in headers.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def body_modes(msg: pb.ProcessingRequest, default: int) -> tuple[int, int]:
    """The request and response body modes Envoy runs this stream in: what it says in
    ``protocol_config`` (on the first message, Envoy 1.32 and later), else ``default``."""
    if msg.HasField("protocol_config"):
        cfg = msg.protocol_config
        return cfg.request_body_mode or default, cfg.response_body_mode or default
    return default, default


def _lb_field(msg: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    meta = msg.metadata_context.filter_metadata
    if namespace not in meta:
        return None
    fields = meta[namespace].fields
    return fields.get(key)


def subset_hint(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the request may go to (``envoy.lb.subset_hint``: a list, or one comma
    string), or None where Envoy sent no hint."""
    value = _lb_field(msg, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        return frozenset()
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(msg: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy sent the request to, as its response headers report it."""
    value = _lb_field(msg, LB_NAMESPACE, SERVED)
    return value.string_value if value is not None and value.string_value else None


def _option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def mutation(set_: Mapping[str, str], remove: Sequence[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[_option(k.lower(), v) for k, v in set_.items()], remove_headers=remove
    )


def pick_metadata(endpoints: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}``."""
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoints
    return meta


def request_headers_response(
    headers: pb.HeaderMutation | None = None, metadata: struct_pb2.Struct | None = None
) -> pb.ProcessingResponse:
    """The answer to the request headers: the pick (``headers`` setting the destination,
    ``metadata`` the same in ``envoy.lb``), or, before the body, just "go on"."""
    common = pb.CommonResponse()
    if headers is not None:
        common.header_mutation.CopyFrom(headers)
        common.clear_route_cache = True  # the route may depend on the destination
    out = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
    if metadata is not None:
        out.dynamic_metadata.CopyFrom(metadata)
    return out


def buffered_body_response(
    headers: pb.HeaderMutation, metadata: struct_pb2.Struct, body: bytes | None
) -> pb.ProcessingResponse:
    """Buffered mode's answer to the whole body: the pick, and the body when it changed."""
    common = pb.CommonResponse(header_mutation=headers, clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    out = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    out.dynamic_metadata.CopyFrom(metadata)
    return out


def streamed_chunks(body: bytes, end: bool, response: bool = False) -> list[pb.ProcessingResponse]:
    """``body`` as full-duplex ``streamed_response`` answers of at most ``CHUNK_BYTES``, the
    last carrying ``end``; an empty body is one empty chunk (it may carry the end)."""
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    out = []
    for n, piece in enumerate(pieces):
        common = pb.CommonResponse()
        common.body_mutation.streamed_response.body = piece
        common.body_mutation.streamed_response.end_of_stream = end and n == len(pieces) - 1
        answer = pb.BodyResponse(response=common)
        out.append(
            pb.ProcessingResponse(response_body=answer)
            if response
            else pb.ProcessingResponse(request_body=answer)
        )
    return out


def response_headers_response(add: Mapping[str, str]) -> pb.ProcessingResponse:
    """The answer to the replica's response headers: ``add`` set on what the client gets."""
    common = pb.CommonResponse(header_mutation=mutation(add))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def response_body_response() -> pb.ProcessingResponse:
    """Buffered mode's answer to the response body: unchanged."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))


def trailers_response(response: bool) -> pb.ProcessingResponse:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """Envoy answers the client itself: ``status``, ``headers`` and ``body``."""
    answer = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=mutation(headers),
        body=body,
    )
    return pb.ProcessingResponse(immediate_response=answer)
