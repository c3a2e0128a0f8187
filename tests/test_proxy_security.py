"""The proxy path against hostile or quirky peers, over real sockets: interim 1xx answers
never desynchronise a pooled connection (a cross-tenant leak), only allowed client headers
reach a replica, request content codings and media types are checked, and a stream cut
upstream reaches the client as an error, never as a clean end."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.upstream.client import UpstreamError, UpstreamPool
from tests.helpers import chat_body
from tests.test_tenancy import bearer, keys_file

Reply = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawReplica:
    """A raw HTTP/1.1 server: GET /health answers 200 and GET /v1/models lists the model
    (so a gateway is ready and routes to it), other GETs and the gateway's parity probe 404
    (its /tokenize is not checked; not recorded); each other POST goes to
    ``reply(head, body, writer)``. Records what it received."""

    reply: Reply
    connections: int = 0
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    post_connections: set[int] = field(default_factory=set)  # which connections carried POSTs
    url: str = ""

    def posts_headers(self) -> list[dict[str, str]]:
        return [parse_head(head) for head, _ in self.requests]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(parse_head(head).get("content-length", "0"))
                body = await reader.readexactly(length)
                if head.startswith(b"GET /v1/models "):
                    writer.write(json_answer(MODELS))  # as vLLM lists its model
                elif head.startswith(b"GET ") or PROBE_HEADER in head.lower():
                    status = b"200 OK" if head.startswith(b"GET /health ") else b"404 Not Found"
                    writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
                else:
                    self.requests.append((head, body))
                    self.post_connections.add(number)
                    await self.reply(head, body, writer)
                await writer.drain()
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


PROBE_HEADER = b"x-prefix-router-probe: parity"
MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B", "object": "model"}]}


def parse_head(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            out[k.decode().strip().lower()] = v.decode("utf-8", "replace").strip()
    return out


def json_answer(obj: Any, status: bytes = b"200 OK") -> bytes:
    data = json.dumps(obj).encode()
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(data)).encode()
        + b"\r\n\r\n"
        + data
    )


@pytest.fixture
async def raw_replica() -> AsyncIterator[Callable[[Reply], Awaitable[RawReplica]]]:
    servers: list[asyncio.base_events.Server] = []

    async def start(reply: Reply) -> RawReplica:
        raw = RawReplica(reply)
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return raw

    yield start
    for s in servers:
        s.close()


def user_text(body: bytes) -> str:
    return str(json.loads(body)["messages"][-1]["content"])


async def continue_then_echo(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
    """Always an interim 100 Continue first (asked for or not), the real answer later: it
    names the request it answers (the user's text and the salt it carried)."""
    w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    await w.drain()
    await asyncio.sleep(0.05)  # the interim answer and the final one arrive apart
    req = json.loads(body)
    w.write(json_answer({"echo": user_text(body), "salt": req.get("cache_salt")}))


# -- the upstream client ------------------------------------------------------------------


async def test_pool_skips_interim_answers_and_reuses_the_connection(raw_replica):
    async def early_hints_too(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(json_answer({"n": json.loads(body)["n"]}))

    server = await raw_replica(early_hints_too)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    for n in range(4):
        resp = await pool.post(server.url + "/x", json.dumps({"n": n}).encode(), {})
        assert resp.status == 200
        assert resp.header("link") == ""  # the interim answer's headers are not the response's
        assert json.loads(await resp.read()) == {"n": n}
    assert len(server.post_connections) == 1
    pool.close()


async def test_pool_rejects_101_and_endless_interim_answers(raw_replica):
    async def switching(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n")

    async def endless(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 50)

    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    for reply in (switching, endless):
        server = await raw_replica(reply)
        with pytest.raises(UpstreamError, match="bad response"):
            await pool.post(server.url + "/", b"{}", {})
    assert not any(pool._idle.values())
    pool.close()


async def test_a_response_not_read_to_its_end_never_goes_back_to_the_pool(raw_replica):
    async def big_then_small(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        if body == b"big":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"a" * 1000)
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"a" * 99000)
        else:
            w.write(json_answer({"small": True}))

    server = await raw_replica(big_then_small)
    pool = UpstreamPool(connect_timeout=5, read_timeout=5)
    resp = await pool.post(server.url + "/", b"big", {})
    first = await resp.iter_chunks().__anext__()
    assert first.startswith(b"a")
    resp.release()  # the rest of the body is still on its way: this must drop the socket
    resp = await pool.post(server.url + "/", b"small", {})
    assert json.loads(await resp.read()) == {"small": True}
    assert len(server.post_connections) == 2
    pool.close()


# -- through the gateway -----------------------------------------------------------------


async def tenant_gateway(tmp_path: Path, gateway: Any, url: str, **overrides: Any) -> Any:
    path = keys_file(tmp_path / "keys.yaml", tenants=["acme", "globex"])
    return await gateway([url], auth=True, api_keys_file=str(path), **overrides)


async def test_expect_continue_never_hands_one_tenants_answer_to_another(
    tmp_path, raw_replica, gateway
):
    server = await raw_replica(continue_then_echo)
    gw = await tenant_gateway(tmp_path, gateway, server.url)
    url = gw.url + "/v1/chat/completions"

    async def ask(s: aiohttp.ClientSession, tenant: str, i: int) -> tuple[str, int, Any]:
        text = f"{tenant} question {i}"
        async with s.post(
            url, json=chat_body(text), headers=bearer(tenant), expect100=True
        ) as resp:
            return text, resp.status, await resp.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        sequential = [await ask(s, t, i) for i in range(3) for t in ("acme", "globex")]
        pooled_connections = len(server.post_connections)
        concurrent = await asyncio.gather(
            *(ask(s, t, i) for i in range(3, 9) for t in ("acme", "globex"))
        )
    salts = {}
    for text, status, body in sequential + concurrent:
        assert status == 200, body
        assert body["echo"] == text  # its own answer, never the request before it
        salts.setdefault(text.split()[0], set()).add(body["salt"])
    # Each tenant's answers carry only its own salt; the two never meet.
    assert len(salts["acme"]) == len(salts["globex"]) == 1
    assert salts["acme"] != salts["globex"]
    assert pooled_connections == 1  # the sequential ones really shared one pooled socket
    assert all("expect" not in h for h in server.posts_headers())


async def answer_ok(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
    w.write(json_answer({"ok": True}))


CLIENT_HEADERS = {
    "Accept": "application/json",
    "User-Agent": "OpenAI/Python 1.0",
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "vendor=1",
    "baggage": "k=v",
    "OpenAI-Beta": "assistants=v2",
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "tools-2024",
    "X-Request-Id": "client-rid-1",
    "X-Tenant": "globex",
    "X-Forwarded-For": "10.0.0.1",
    "X-Custom": "custom",
    "X-Hop": "named by Connection",
    "Connection": "keep-alive, X-Hop",
    "Keep-Alive": "timeout=5",
    "TE": "trailers",
    "Trailer": "X-Checksum",
    "Upgrade": "h2c",
    "Proxy-Authorization": "Basic c2VjcmV0",
    "Proxy-Connection": "keep-alive",
    "Accept-Encoding": "gzip, br",
}
ALLOWED = {
    "accept",
    "user-agent",
    "traceparent",
    "tracestate",
    "baggage",
    "openai-beta",
    "anthropic-version",
    "anthropic-beta",
}
NEVER = {
    "expect",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "x-hop",
    "accept-encoding",
    "content-encoding",
}
# What the gateway itself sets on every forwarded request.
OWN = {"host", "content-length", "content-type", "x-request-id"}


async def forwarded(gw: Any, server: RawReplica, extra: dict[str, str] | None = None) -> Any:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s,
        s.post(
            gw.url + "/v1/chat/completions",
            data=json.dumps(chat_body("which headers?")),
            headers={**CLIENT_HEADERS, "Content-Type": "application/json", **(extra or {})},
            expect100=True,
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
    return server.posts_headers()[-1]


@pytest.mark.parametrize(
    "auth,forward_headers,passes",
    [
        (True, [], ALLOWED),
        (True, ["X-Custom", "Connection", "Accept-Encoding"], ALLOWED | {"x-custom"}),
        (False, [], ALLOWED | {"x-tenant", "x-forwarded-for", "x-custom"}),
        (False, ["x-custom"], ALLOWED | {"x-custom"}),
    ],
)
async def test_only_allowed_client_headers_reach_the_replica(
    tmp_path, raw_replica, gateway, auth, forward_headers, passes
):
    server = await raw_replica(answer_ok)
    if auth:
        gw = await tenant_gateway(tmp_path, gateway, server.url, forward_headers=forward_headers)
        got = await forwarded(gw, server, bearer("acme"))
    else:
        gw = await gateway([server.url], forward_headers=forward_headers)
        got = await forwarded(gw, server)
    assert set(got) == passes | OWN, set(got) ^ (passes | OWN)
    assert not NEVER & set(got)
    for name in passes:
        assert got[name] == next(v for k, v in CLIENT_HEADERS.items() if k.lower() == name)
    assert got["x-request-id"] == "client-rid-1"  # the gateway's id (it kept the client's)
    assert got["content-type"] == "application/json"
    assert "authorization" not in got  # a tenant's gateway key never reaches a replica


# -- request content codings and media types ----------------------------------------------


async def send_raw(
    url: str, data: bytes, headers: dict[str, str], skip: tuple[str, ...] = ()
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s,
        s.post(url, data=data, headers=headers, skip_auto_headers=skip) as resp,
    ):
        raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw


def assert_openai_error(body: Any, status: int, got: int) -> dict[str, Any]:
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


async def test_compressed_bodies_are_forwarded_decoded_and_unlabelled(raw_replica, gateway):
    server = await raw_replica(answer_ok)
    gw = await gateway([server.url])
    url = gw.url + "/v1/chat/completions"
    plain = json.dumps(chat_body("compressed")).encode()
    half = len(plain) // 2
    cases = {
        "gzip": gzip.compress(plain),
        "x-gzip": gzip.compress(plain),
        "GZIP": gzip.compress(plain[:half]) + gzip.compress(plain[half:]),  # two members
        "deflate": zlib.compress(plain),
        "identity": plain,
    }
    for coding, data in cases.items():
        status, body = await send_raw(
            url, data, {"Content-Type": "application/json", "Content-Encoding": coding}
        )
        assert status == 200, (coding, body)
        head, forwarded_body = server.requests[-1]
        assert forwarded_body == plain, coding
        assert "content-encoding" not in parse_head(head), coding
    # Raw deflate (no zlib wrapper), as some clients send it, reaches a real replica too.
    status, body = await send_raw(
        url,
        raw_deflate(plain),
        {"Content-Type": "application/json", "Content-Encoding": "deflate"},
    )
    assert status == 200 and server.requests[-1][1] == plain


async def test_compressed_body_reaches_a_simulated_vllm_replica(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    data = gzip.compress(json.dumps(chat_body("gzip to vllm")).encode())
    status, body = await send_raw(
        gw.url + "/v1/chat/completions",
        data,
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert status == 200, body  # the replica got plain JSON without a gzip label
    assert body["choices"][0]["message"]["content"]


async def test_bad_content_codings_get_openai_4xx(raw_replica, gateway):
    server = await raw_replica(answer_ok)
    gw = await gateway([server.url])
    url = gw.url + "/v1/chat/completions"
    plain = json.dumps(chat_body("x")).encode()
    bad = {
        "gzip": plain,  # labelled gzip, sent plain
        "deflate": b"\x78\x9c" + b"not deflate at all",
    }
    for coding, data in {**bad, "x-gzip": gzip.compress(plain)[:-12]}.items():  # truncated
        status, body = await send_raw(
            url, data, {"Content-Type": "application/json", "Content-Encoding": coding}
        )
        err = assert_openai_error(body, 400, status)
        assert err["message"] == f"request body is not valid {coding}", err
    for coding in ("br", "compress", "gzip, gzip", "zstd"):
        status, body = await send_raw(
            url, plain, {"Content-Type": "application/json", "Content-Encoding": coding}
        )
        err = assert_openai_error(body, 415, status)
        assert err["code"] == "unsupported_content_encoding" and "gzip" in err["message"]
    assert server.requests == []  # none of them reached the replica
    status, _ = await send_raw(url, plain, {"Content-Type": "application/json"})
    assert status == 200  # and the gateway still serves


async def test_a_gzip_bomb_is_refused_without_inflating_it(raw_replica, gateway):
    server = await raw_replica(answer_ok)
    limit = 1_000_000
    gw = await gateway([server.url], max_body_bytes=limit)
    inflated = 200 * limit  # 200 MB of zeros in about 200 kB
    c = zlib.compressobj(9, wbits=16 + zlib.MAX_WBITS)
    zeros = bytes(limit)
    bomb = b"".join(c.compress(zeros) for _ in range(inflated // limit)) + c.flush()
    assert len(bomb) < limit  # the compressed body itself is within the limit
    tracemalloc.start()
    try:
        status, body = await send_raw(
            gw.url + "/v1/chat/completions",
            bomb,
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = assert_openai_error(body, 413, status)
    assert "decompressed" in err["message"]
    assert peak < 20 * limit, peak  # a bounded inflate, nowhere near the 200 MB
    assert server.requests == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
async def test_content_type_missing_is_json_and_other_types_are_415(raw_replica, gateway, path):
    server = await raw_replica(answer_ok)
    gw = await gateway([server.url])
    url = gw.url + path
    body = chat_body("x") if path == "/v1/chat/completions" else {"prompt": "x", "max_tokens": 1}
    data = json.dumps(body).encode()
    status, got = await send_raw(url, data, {}, skip=("Content-Type",))
    assert status == 200, got
    assert parse_head(server.requests[-1][0])["content-type"] == "application/json"
    for ok in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
        status, got = await send_raw(url, data, {"Content-Type": ok})
        assert status == 200, (ok, got)
    forwarded_before = len(server.requests)
    for wrong in (
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "application/octet-stream",
    ):
        status, got = await send_raw(url, data, {"Content-Type": wrong})
        err = assert_openai_error(got, 415, status)
        assert "application/json" in err["message"] and wrong.split(";")[0] in err["message"]
        assert err["code"] == "unsupported_media_type"
    assert len(server.requests) == forwarded_before


# -- a stream cut upstream ------------------------------------------------------------------

CUT_EVENT = {
    "error": {
        "message": "upstream replica closed the stream before it finished",
        "type": "server_error",
        "code": "upstream_stream_cut",
    }
}


async def read_cut_stream(url: str, body: dict[str, Any], on_first: Any = None) -> list[bytes]:
    """The ``data:`` payloads received; asserts the body ended truncated, not cleanly."""
    events: list[bytes] = []
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s,
        s.post(url, json=body) as resp,
    ):
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if on_first is not None and len(events) == 1:
                        await on_first()
    return events


async def test_a_stream_cut_upstream_ends_with_an_error_event_and_a_truncated_body(fleet, gateway):
    replicas = await fleet(1, decode_tokens_per_s=20)
    gw = await gateway([replicas[0].url], eject_after_failures=100)
    body = chat_body("a long story", stream=True, max_tokens=200)
    events = await read_cut_stream(gw.url + "/v1/chat/completions", body, replicas[0].stop)
    assert len(events) >= 2
    assert json.loads(events[0])["choices"]  # a real chunk came first
    assert json.loads(events[-1]) == CUT_EVENT
    assert b"[DONE]" not in events
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert 'outcome="broken"' in text  # the outcome stays incomplete


async def test_a_stream_cut_mid_event_still_gets_a_separate_error_event(raw_replica, gateway):
    async def half_an_event(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for part in (b'data: {"choices": [{"index": 0}]}\n\n', b'data: {"choi'):
            w.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await w.drain()
            await asyncio.sleep(0.02)
        w.transport.abort()

    server = await raw_replica(half_an_event)
    gw = await gateway([server.url], eject_after_failures=100)
    events = await read_cut_stream(gw.url + "/v1/chat/completions", chat_body("x", stream=True))
    assert events[0] == b'{"choices": [{"index": 0}]}'
    assert events[1] == b'{"choi'  # what the replica sent is relayed as it was
    assert json.loads(events[-1]) == CUT_EVENT  # and the error is an event of its own


def test_stream_error_shapes():
    from router.upstream.proxy import stream_error_event

    anthropic = stream_error_event("anthropic", "gone")
    assert anthropic.startswith(b"event: error\ndata: ") and anthropic.endswith(b"\n\n")
    assert json.loads(anthropic.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "gone"},
    }
    openai = stream_error_event("openai")
    assert json.loads(openai.removeprefix(b"data: ")) == CUT_EVENT
