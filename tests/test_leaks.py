"""Smaller leaks (issue 28, item 10), over real sockets: credentials in log lines at any
level, request ids that count requests, a client's huge string echoed whole, replica URLs in
a header every tenant sees, a compressed upload forwarded still compressed but labelled
plain, and an upstream's 200 KB header relayed."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.helpers import chat_body, post, serve

MODEL = "Qwen/Qwen3-0.6B"
KEY = "sk-acme-SECRETKEY0123456789"
ADMIN = "admin-SECRETADMIN9876543210"


def _keys(tmp_path: Path) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump({"salt_secrets": "z" * 32, "tenants": {"acme": {"keys": [KEY]}}})
    )
    return str(path)


class FakeReplica:
    """A replica answering /health, /metrics and /v1/models, with the generation and upload
    routes a test gives; it keeps what it received."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.big_header = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]}
        )

    async def _answer(self, request: web.Request) -> web.Response:
        self.received.append((dict(request.headers), await request.read()))
        headers = {"X-Big": "b" * 200_000} if self.big_header else {}
        body = {"id": "x", "object": "chat.completion", "choices": [], "text": "ok"}
        return web.Response(text=json.dumps(body), content_type="application/json", headers=headers)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/metrics", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/audio/transcriptions", self._answer)
        self.runner, self.url = await serve(app)


@pytest.fixture
async def fake() -> AsyncIterator[FakeReplica]:
    replica = FakeReplica()
    await replica.start()
    yield replica
    assert replica.runner is not None
    await replica.runner.cleanup()


async def _raw(url: str, payload: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    answer = await reader.read(65536)
    writer.close()
    return answer


async def test_credentials_are_in_no_log_line(tmp_path, fleet, gateway, caplog):
    caplog.set_level(logging.DEBUG)
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], auth=True, api_keys_file=_keys(tmp_path), admin_key=ADMIN)
    secrets = (KEY, ADMIN, "SECRETWRONG", "SECRETCOOKIE", "SECRETBASIC")
    for payload in (
        # Malformed heads aiohttp logs with the offending line, key and all.
        f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\x01\r\n\r\n",
        f"GET /health HTTP/1.1\r\nHost: x\r\nX-Admin-Key: {ADMIN}\x01\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: x\r\nCookie: s=SECRETCOOKIE\x01\r\n\r\n",
        f"GET /health HTTP/1.1\r\nHost: x\r\nno colon here {KEY}\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Basic SECRETBASIC\x01\r\n\r\n",
    ):
        assert (await _raw(gw.url, payload.encode())).startswith(b"HTTP/1.")
    async with aiohttp.ClientSession() as s:
        wrong = {"Authorization": "Bearer sk-acme-SECRETWRONG0000"}
        status, _, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("hi"), wrong)
        assert status == 401
        async with s.get(gw.url + "/metrics", headers={"X-Admin-Key": "SECRETWRONG"}) as r:
            assert r.status == 401
        ok = {"Authorization": f"Bearer {KEY}"}
        status, _, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("hi"), ok)
        assert status == 200
    # Any logger of the process, at any level, whatever the message says.
    logging.getLogger("router.fleet.discovery").debug("retrying with Authorization: Bearer %s", KEY)
    logging.getLogger("some.library").debug("x-api-key=%s cookie=%s", KEY, "SECRETCOOKIE")
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert "Invalid header" in logged  # the malformed heads were logged, redacted
    for secret in secrets:
        assert secret not in logged


async def test_gateway_request_ids_are_random(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    ids = []
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            async with s.get(gw.url + "/health") as r:
                ids.append(r.headers["x-request-id"])
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids)
    # No shared prefix, no counter: one request's id says nothing of how many came before.
    assert len({i[:8] for i in ids}) == len(ids)
    assert (
        len({int(b, 16) - int(a, 16) for a, b in zip(ids, ids[1:], strict=False)}) == len(ids) - 1
    )


async def test_a_huge_model_name_is_cut_in_the_error(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        body = {**chat_body("hi"), "model": "m" * 1_000_000}
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", body)
    assert status == 404, str(answer)[:300]
    assert answer["error"]["param"] == "model"
    assert len(json.dumps(answer)) < 1000
    # Any other error quoting a client's string stays short too.
    async with aiohttp.ClientSession() as s:
        body = chat_body("hi", messages=[{"role": "user", "content": [{"type": "x" * 100_000}]}])
        status, _, answer = await post(s, gw.url + "/v1/chat/completions", body)
    assert status == 400, str(answer)[:300]
    assert len(json.dumps(answer)) < 1500


async def test_replica_header_is_off_with_auth_and_never_a_url(tmp_path, fleet, gateway):
    replicas = await fleet(1)
    urls = [replicas[0].url]
    keys = _keys(tmp_path)
    ok = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        default = await gateway(urls, auth=True, api_keys_file=keys)
        status, headers, _ = await post(s, default.url + "/v1/chat/completions", chat_body("a"), ok)
        assert status == 200 and "x-prefix-router-replica" not in headers
        named = await gateway(urls, auth=True, api_keys_file=keys, decision_headers=True)
        status, headers, _ = await post(s, named.url + "/v1/chat/completions", chat_body("b"), ok)
        assert status == 200 and headers["x-prefix-router-replica"] == "replica-0"
        open_ = await gateway(urls)  # auth off: as before, the URL
        status, headers, _ = await post(s, open_.url + "/v1/chat/completions", chat_body("c"))
        assert status == 200 and headers["x-prefix-router-replica"] == urls[0]


async def test_a_compressed_upload_is_forwarded_decoded(gateway, fake):
    gw = await gateway([fake.url])
    b = "formboundary7MA4YWxk"
    plain = (
        (
            f'--{b}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'
            f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + b"RIFF"
        + bytes(range(256)) * 40
        + f"\r\n--{b}--\r\n".encode()
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions",
            data=gzip.compress(plain),
            headers={
                "Content-Type": f"multipart/form-data; boundary={b}",
                "Content-Encoding": "gzip",
            },
        ) as r,
    ):
        assert r.status == 200, await r.text()
    headers, body = fake.received[-1]
    assert body == plain
    assert "Content-Encoding" not in headers


async def test_an_upstream_header_past_the_cap_is_not_relayed(gateway, fake):
    gw = await gateway([fake.url], max_retries=0)
    fake.big_header = True
    async with aiohttp.ClientSession(max_field_size=1 << 20, max_line_size=1 << 20) as s:
        status, headers, answer = await post(s, gw.url + "/v1/chat/completions", chat_body("hi"))
    assert status == 502, str(answer)[:200]
    assert "X-Big" not in headers
    assert answer["error"]["code"] == "upstream_unavailable"
