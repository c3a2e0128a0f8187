"""Shared budgets no one client can exhaust, and the ops routes behind the same bounds (issue
28): explain reads its body through the one bounded reader after its checks; body bytes in
flight are counted as they arrive, per tenant (auth on) or per peer address (auth off).

Raw sockets, as a hostile client would send; distinct loopback addresses (127.0.0.2,
127.0.0.3) stand for distinct peers. Every wait is on a socket event or an observable
counter, never a sleep."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.helpers import chat_body, post, wait_for

KEYS = {"acme": "sk-acme-5d1c0b9a8f7e6d5c4b3a", "globex": "sk-globex-0f1e2d3c4b5a69788796"}
ANSWER_WAIT_S = 15  # a guard for a test that fails, not a synchronisation


def keys_file(path: Path) -> str:
    tenants = {t: {"keys": [k]} for t, k in KEYS.items()}
    path.write_text(yaml.safe_dump({"tenants": tenants, "salt_secrets": [{"secret": "s" * 32}]}))
    return str(path)


def bearer(tenant: str) -> str:
    return f"Authorization: Bearer {KEYS[tenant]}\r\n"


async def open_body(
    url: str,
    length: int,
    sent: bytes | int,
    headers: str = "",
    *,
    path: str = "/v1/chat/completions",
    peer: str = "127.0.0.1",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from ``peer`` that sends a request head announcing ``length`` body
    bytes, then ``sent`` (bytes, or that many spaces), and no more."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(peer, 0))
    body = b" " * sent if isinstance(sent, int) else sent
    writer.write(
        (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{headers}\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> tuple[int, Any]:
    """The status and JSON body of the one answer on a connection the gateway then closes."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
    rest = await asyncio.wait_for(reader.read(), ANSWER_WAIT_S)
    return int(head.split(b" ", 2)[1]), json.loads(rest)


async def request(
    url: str, body: dict[str, Any], headers: str = "", *, path: str, peer: str = "127.0.0.1"
) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    reader, writer = await open_body(
        url, len(raw), raw, headers + "Connection: close\r\n", path=path, peer=peer
    )
    try:
        return await answer(reader)
    finally:
        writer.close()


# -- explain: the admin check, then the tenant's key, then the bounded reader ----------------


async def test_explain_checks_the_key_before_reading_the_body(tmp_path, fleet, gateway):
    """Auth on, no admin key: an explain without a tenant key is a 401 with most of its
    30 MB body never sent (it was read, inflated and parsed first)."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], auth=True, api_keys_file=keys_file(tmp_path / "k"))
    reader, writer = await open_body(gw.url, 30_000_000, 1 << 20, path="/v1/route/explain")
    try:
        status, body = await answer(reader)
    finally:
        writer.close()
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    status, body = await request(
        gw.url, chat_body("explain me"), bearer("acme"), path="/v1/route/explain"
    )
    assert status == 200 and body["tenant"] == "acme", body


async def test_without_an_admin_key_explain_answers_only_admin_networks(fleet, gateway):
    """With no admin key, explain answers only peers in admin_networks (loopback by default;
    here 127.0.0.2 only, so 127.0.0.1 stands for a remote client)."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], admin_networks=["127.0.0.2/32"])
    body = chat_body("explain me")
    status, answer_ = await request(gw.url, body, path="/v1/route/explain", peer="127.0.0.1")
    assert status == 403 and answer_["error"]["code"] == "admin_only", answer_
    assert set(answer_["error"]) == {"message", "type", "param", "code"}
    status, answer_ = await request(gw.url, body, path="/v1/route/explain", peer="127.0.0.2")
    assert status == 200 and answer_["prompt_tokens"] > 0, answer_
    # Diagnostics stay off without an admin key, from anywhere.
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/diagnostics") as resp:
        assert resp.status == 404


async def test_a_trickled_explain_body_meets_the_body_timeout(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], body_timeout_s=0.5)
    reader, writer = await open_body(gw.url, 10_000, b'{"messages": [', path="/v1/route/explain")
    try:
        status, body = await answer(reader)  # and the rest never comes
    finally:
        writer.close()
    assert status == 408 and body["error"]["code"] == "body_timeout", body
    assert gw.gateway.receiving_bytes == 0


# -- the in-flight body-byte budget: counted as bytes arrive, shared fairly -----------------


async def test_announced_lengths_reserve_nothing(tmp_path, fleet, gateway):
    """The issue's attack: 8 connections announcing the largest body and sending one byte.
    Each byte counts as it arrives, so they hold 8 bytes, and another tenant is served
    (before, the announced 8 MB were reserved: the 4 MB budget was full)."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        auth=True,
        api_keys_file=keys_file(tmp_path / "k"),
        max_body_bytes=1_000_000,
        max_inflight_body_bytes=4_000_000,
        client_share=1.0,  # the total alone: shares are the next test's
    )
    held = [await open_body(gw.url, 1_000_000, 1, bearer("acme")) for _ in range(8)]

    async def all_receiving() -> bool:
        return gw.gateway.receiving_bytes == 8

    await wait_for(all_receiving, what="8 bodies being received, one byte each")
    status, body = await request(
        gw.url, chat_body("served"), bearer("globex"), path="/v1/chat/completions"
    )
    assert status == 200, body
    for _, writer in held:
        writer.close()


async def test_one_tenant_cannot_take_the_whole_byte_budget(tmp_path, fleet, gateway):
    """acme sends real bytes on several bodies: it holds at most its share (a quarter of the
    in-flight budget); its next body is refused and globex's bodies are still received."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        auth=True,
        api_keys_file=keys_file(tmp_path / "k"),
        max_body_bytes=1_000_000,
        max_inflight_body_bytes=4_000_000,
        client_share=0.25,
    )
    held = [await open_body(gw.url, 1_000_000, 600_000, bearer("acme"))]

    async def acme_holds() -> bool:
        return gw.gateway.receiving_bytes == 600_000

    await wait_for(acme_holds, what="acme's first body half received")
    reader, writer = await open_body(gw.url, 1_000_000, 600_000, bearer("acme"))
    status, body = await answer(reader)  # 1.2 MB would be over acme's 1 MB share
    writer.close()
    assert status == 503 and body["error"]["code"] == "overloaded", body
    assert "this client" in body["error"]["message"]
    # globex: one body held half-sent beside acme's, and a whole request served.
    held.append(await open_body(gw.url, 1_000_000, 900_000, bearer("globex")))

    async def both_hold() -> bool:
        return gw.gateway.receiving_bytes == 1_500_000

    await wait_for(both_hold, what="globex's body received beside acme's")
    status, body = await request(
        gw.url, chat_body("served"), bearer("globex"), path="/v1/chat/completions"
    )
    assert status == 200, body
    rejected = gw.gateway.metrics.registry.get_sample_value(
        "prefix_router_rejected_requests_total", {"reason": "client_inflight_bytes"}
    )
    assert rejected == 1
    for _, writer in held:
        writer.close()

    async def released() -> bool:
        return gw.gateway.receiving_bytes == 0

    await wait_for(released, what="the held bodies' bytes given back")


async def test_without_auth_each_peer_address_has_its_share(fleet, gateway):
    """Auth off: anyone can name any tenant, so the share is the peer address's."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url],
        max_body_bytes=1_000_000,
        max_inflight_body_bytes=4_000_000,
        tenant_header="X-Tenant",
    )
    hog = "127.0.0.2"
    held = [await open_body(gw.url, 1_000_000, 900_000, "X-Tenant: a\r\n", peer=hog)]

    async def hog_holds() -> bool:
        return gw.gateway.receiving_bytes == 900_000

    await wait_for(hog_holds, what="the hog's body received")
    # Naming another tenant does not give the same peer another share.
    reader, writer = await open_body(gw.url, 1_000_000, 200_000, "X-Tenant: b\r\n", peer=hog)
    status, body = await answer(reader)
    writer.close()
    assert status == 503 and body["error"]["code"] == "overloaded", body
    status, body = await request(
        gw.url, chat_body("hi"), path="/v1/chat/completions", peer="127.0.0.3"
    )
    assert status == 200, body
    for _, writer in held:
        writer.close()


async def test_the_shared_reader_serves_every_body_route(tmp_path, fleet, gateway):
    """Chat, Messages, Responses, a forwarded route and /tokenize all read through it: a
    trickled body on each meets the body timeout."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], body_timeout_s=0.5)
    paths = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings", "/tokenize"]
    for path in paths:
        reader, writer = await open_body(gw.url, 10_000, b"{", path=path)
        try:
            status, body = await answer(reader)
        finally:
            writer.close()
        assert status == 408, (path, body)
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw.url + "/v1/chat/completions", chat_body("hi")))[0] == 200


# -- connections: per-peer shares of the cap, a short keep-alive until a request is identified


async def hold_after_health(
    url: str, peer: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A connection from ``peer`` that did one GET /health: (reader, writer, its status)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(peer, 0))
    writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    await reader.readexactly(length)
    return reader, writer, int(head.split(b" ", 2)[1])


async def test_one_peer_cannot_hold_every_connection_slot(fleet, gateway):
    """The issue's attack at a smaller scale: one peer opens as many keep-alive connections
    as the cap (each did a GET /health). It holds its share (a quarter), the rest are
    closed after their probe answer, and a client from another address is served."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_connections=8, keepalive_timeout_s=60)
    server = gw.runner.server
    held = [await hold_after_health(gw.url, "127.0.0.2") for _ in range(8)]
    assert all(status == 200 for _, _, status in held)  # probes are answered even so

    async def share_held() -> bool:
        return server.open_connections == 2  # the other six were closed after their answer

    await wait_for(share_held, what="the hog's connections beyond its share closed")
    status, body = await request(
        gw.url, chat_body("served"), path="/v1/chat/completions", peer="127.0.0.3"
    )
    assert status == 200, body
    rejected = gw.gateway.metrics.registry.get_sample_value(
        "prefix_router_rejected_requests_total", {"reason": "peer_connections"}
    )
    assert rejected == 6
    for _, writer, _ in held:
        writer.close()


async def test_a_peer_reconnecting_beyond_its_share_is_closed_unanswered(fleet, gateway):
    """A peer holding its share and opening more: the first connection beyond it is
    answered (its probe; a request would get the 503), then, with the peer's refusal bucket
    empty, the next ones are closed as they are accepted, unread and unanswered (a reconnect
    loop costs the loop an accept and a close). Another peer is served meanwhile."""
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], max_connections=8, keepalive_timeout_s=60, peer_refusals_per_s=0.01
    )
    held = [await hold_after_health(gw.url, "127.0.0.2") for _ in range(2)]  # its share
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    answers = []
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        try:
            answers.append(await asyncio.wait_for(reader.read(), ANSWER_WAIT_S))
        except ConnectionResetError:  # closed with the request unread
            answers.append(b"")
        writer.close()
    assert answers[0].startswith(b"HTTP/1.1 200"), answers[0]
    assert answers[1:] == [b""] * 4, answers
    status, body = await request(
        gw.url, chat_body("served"), path="/v1/chat/completions", peer="127.0.0.3"
    )
    assert status == 200, body
    assert gw.runner.server.open_connections == 2  # the share, still held
    rejected = gw.gateway.metrics.registry.get_sample_value(
        "prefix_router_rejected_requests_total", {"reason": "peer_connections"}
    )
    assert rejected == 5
    for _, writer, _ in held:
        writer.close()


async def test_a_connection_that_identified_no_request_gets_a_short_keep_alive(fleet, gateway):
    """A keep-alive connection that only did GET /health is closed after
    unauthenticated_keepalive_s; one that carried an identified request keeps the long
    keep-alive: it is still open after the short one has closed."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], keepalive_timeout_s=60, unauthenticated_keepalive_s=0.3)
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    raw = json.dumps(chat_body("identified")).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(raw) + raw
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    await reader.readexactly(length)
    # Opened after it, closed by the gateway while it sits idle:
    r2, w2, status = await hold_after_health(gw.url, "127.0.0.1")
    assert status == 200
    assert await asyncio.wait_for(r2.read(), ANSWER_WAIT_S) == b""
    w2.close()
    writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")  # the identified one is still open
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()


# -- large bodies: parsed out of process first, so a bomb never holds this process's GIL ----


def bomb(messages: int) -> bytes:
    """A chat body of ``messages`` one-word messages, gzipped (31 MiB in ~70 KB at 600k)."""
    one = b'{"role":"user","content":"x"},'
    raw = b'{"model":"Qwen/Qwen3-0.6B","messages":[' + one * messages + b'{"role":"user"}]}'
    return gzip.compress(raw, 6)


async def test_a_gzip_bomb_is_refused_from_another_process(tmp_path, fleet, gateway):
    """31 MiB inflated, 600k messages: json.loads held the GIL for 2-3.6 s (in a worker
    thread too). It is parsed and refused in a child process; a small body is parsed here as
    before, and a large body within the limits passes the check and is served."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], auth=True, api_keys_file=keys_file(tmp_path / "k"))
    headers = bearer("acme") + "Content-Encoding: gzip\r\nConnection: close\r\n"
    payload = bomb(600_000)
    reader, writer = await open_body(gw.url, len(payload), payload, headers)
    try:
        status, body = await answer(reader)
    finally:
        writer.close()
    assert status == 400 and body["error"]["param"] == "messages", body
    checks = gw.gateway.metrics.registry.get_sample_value
    assert checks("prefix_router_json_checks_total", {"outcome": "refused"}) == 1
    status, body = await request(
        gw.url, chat_body("small"), bearer("globex"), path="/v1/chat/completions"
    )
    assert status == 200, body
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) is None
    big = chat_body(
        "large", metadata={"pad": "u" * 2_400_000}
    )  # 2.4 MB: checked, within the limits
    status, body = await request(gw.url, big, bearer("globex"), path="/v1/chat/completions")
    assert status == 200, body
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) == 1


async def test_a_dead_checking_process_is_replaced(fleet, gateway):
    """A child killed under the check (out of memory, an operator's kill) is replaced: the
    next large body is checked and served, not a 500 from a broken pool forever after."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    big = chat_body("large", metadata={"pad": "u" * 2_400_000})  # checked out of process
    status, body = await request(gw.url, big, "", path="/v1/chat/completions")
    assert status == 200, body
    pool = gw.gateway.json_check._pool
    assert pool is not None
    for proc in list(pool._processes.values()):
        proc.kill()
        proc.join()
    status, body = await request(gw.url, big, "", path="/v1/chat/completions")
    assert status == 200, body
    checks = gw.gateway.metrics.registry.get_sample_value
    assert checks("prefix_router_json_checks_total", {"outcome": "passed"}) == 2
    assert checks("prefix_router_json_checks_total", {"outcome": "broken"}) == 1
