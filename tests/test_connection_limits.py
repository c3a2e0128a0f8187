"""Header limits at the socket (issue 18): aiohttp's parser bounds the header count (128)
and each header line (8,190 bytes); a request past either is refused with a 4xx and its
connection closed, and the gateway keeps serving. Raw sockets: no client would send these."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.helpers import chat_body, post


async def raw_request(url: str, head: bytes) -> bytes:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)  # until the server closes
    finally:
        writer.close()


@pytest.mark.parametrize(
    "extra",
    [
        b"".join(b"X-H%d: v\r\n" % i for i in range(200)),  # too many headers
        b"X-Big: " + b"a" * 20_000 + b"\r\n",  # one header too long
    ],
    ids=["200 headers", "a 20 kB header"],
)
async def test_oversized_headers_are_refused_and_the_gateway_serves_on(fleet, gateway, extra):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"
    answer = await raw_request(gw.url, head)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:200]
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw.url + "/v1/chat/completions", chat_body("still here")))[0] == 200
