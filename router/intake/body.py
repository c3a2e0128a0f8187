"""Request body intake for the JSON endpoints: check the media type, undo the content coding
within ``max_body_bytes``. Reading the bytes (time, size and in-flight bounds) is
``Handlers.read_body``'s (router/http/handlers.py), the one reader every route uses.

The server runs with aiohttp's own request decompression off (``auto_decompress=False``, see
``start_gateway`` and ``cli``): it turned a plain body labelled gzip into a 500, and it left
the Content-Encoding header on a body it had already decoded. Here the decoded size is
bounded while inflating, so a small gzip bomb costs ``max_body_bytes`` of output, no more.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from router.core.errors import APIError

EXPECTED_TYPE = "application/json"
INLINE_DECODE_BYTES = 64 * 1024  # compressed bodies beyond this are inflated in a thread


def check_content_type(request: web.Request) -> None:
    """A missing Content-Type is JSON (as FastAPI and vLLM take it); any other type is 415."""
    value = request.headers.get("Content-Type", "").strip()
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == EXPECTED_TYPE or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(
        415,
        f"Content-Type must be {EXPECTED_TYPE}, got {media[:100]!r}",
        code="unsupported_media_type",
    )


def _wbits(coding: str, data: bytes) -> int:
    if coding in ("gzip", "x-gzip"):
        return 16 + zlib.MAX_WBITS
    # deflate is the zlib format (RFC 9110 8.4.1.2); some clients send raw deflate instead.
    return zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS


def decode(coding: str, data: bytes, max_bytes: int) -> bytes:
    """``data`` decoded from ``coding`` (gzip, x-gzip, deflate), at most ``max_bytes`` long;
    concatenated gzip members decode as one body."""
    out: list[bytes] = []
    size = 0
    try:
        while True:
            d = zlib.decompressobj(_wbits(coding, data))
            part = d.decompress(data, max_bytes - size + 1)
            size += len(part)
            out.append(part)
            if size > max_bytes:
                raise APIError(
                    413,
                    f"request body too large: more than {max_bytes} bytes once decompressed",
                    code="request_too_large",
                )
            if not d.eof:
                raise zlib.error("truncated")
            data = d.unused_data
            if not data or coding == "deflate":
                break
    except zlib.error:
        raise APIError(
            400, f"request body is not valid {coding}", code="invalid_content_encoding"
        ) from None
    if data and coding == "deflate":  # bytes after the end of the stream
        raise APIError(400, "request body is not valid deflate", code="invalid_content_encoding")
    return b"".join(out)


def content_coding(request: web.Request) -> str:
    """The body's content coding ("" for none), once its type and coding were checked: 415
    for a non-JSON type or an unknown coding. Nothing of the body is read."""
    check_content_type(request)
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity", "gzip", "x-gzip", "deflate"):
        raise APIError(
            415,
            f"Content-Encoding {coding[:50]!r} is not supported; send the body as is, "
            "gzip or deflate",
            code="unsupported_content_encoding",
        )
    return "" if coding == "identity" else coding


async def decode_body(coding: str, raw: bytes, max_bytes: int) -> bytes:
    """``raw`` (as received) decoded from ``coding``: 400 for an undecodable body, 413 past
    ``max_bytes`` decoded."""
    if not coding or not raw:
        return raw
    if len(raw) > INLINE_DECODE_BYTES:
        # Inflating up to max_bytes takes ~0.1 s: off the event loop (zlib releases the GIL).
        return await asyncio.to_thread(decode, coding, raw, max_bytes)
    return decode(coding, raw, max_bytes)
