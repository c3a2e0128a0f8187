"""The held-bytes budget over real sockets: bodies waiting in flow control's queue count
against their tenant's share of what the gateway may hold, charged by their decoded size, so
a tenant sending small gzip bodies with large extra fields is refused past its share while
another tenant still queues and is served. The replica holds one request (``hang_next``), so
everything after it waits in the gateway."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from router.intake.held import HELD_FACTOR
from tests.helpers import chat_body, wait_for

KEYS = {"a": "sk-held-a-0123456789abcdef", "b": "sk-held-b-fedcba9876543210"}
MIB = 1024 * 1024


def keys_file(path: Path, **limits: Any) -> str:
    tenants = {t: {"keys": [k], **limits} for t, k in KEYS.items()}
    secrets = [{"secret": "held-bytes-secret-0123456789abcdef"}]
    path.write_text(yaml.safe_dump({"tenants": tenants, "salt_secrets": secrets}))
    return str(path)


def padded(i: int, pad_bytes: int) -> bytes:
    """A 3-word chat whose extra field holds ``pad_bytes``: gzip makes it a few KB."""
    body = chat_body(f"Question {i} here", padding="x" * pad_bytes)
    return gzip.compress(json.dumps(body).encode())


async def send(
    http: aiohttp.ClientSession, url: str, tenant: str, data: bytes
) -> tuple[int, dict[str, Any]]:
    headers = {
        "Authorization": f"Bearer {KEYS[tenant]}",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }
    async with http.post(url + "/v1/chat/completions", data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_queued_bodies_count_against_their_tenants_held_share(
    fleet, gateway, tmp_path
) -> None:
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url],
        auth=True,
        api_keys_file=keys_file(tmp_path / "keys.yaml"),
        flow_control=True,
        max_body_bytes=MIB,
        max_held_body_bytes=8 * MIB,
        client_share=0.25,  # 2 MiB each: two 600 KB bodies (charged 1.2 MB each) do not fit
    )
    held = gw.gateway.held
    flow = gw.gateway.flow
    pad = 600_000
    body = padded(0, pad)
    assert len(body) < 10_000  # small on the wire, 600 KB once decoded
    async with aiohttp.ClientSession() as http:
        replica.hang_next(1)
        holder = asyncio.create_task(
            send(http, gw.url, "b", gzip.compress(json.dumps(chat_body("hold")).encode()))
        )

        async def hanging() -> bool:
            return replica.hanging == 1

        await wait_for(hanging, what="the held request at the replica")
        first = asyncio.create_task(send(http, gw.url, "a", padded(1, pad)))

        def queued(n: int) -> Any:
            async def check() -> bool:
                return sum(q.size for q in flow.queues.values()) == n

            return check

        await wait_for(queued(1), what="a's first body queued")
        assert held.budget.held_by("tenant:a") >= HELD_FACTOR * pad
        status, err = await send(http, gw.url, "a", padded(2, pad))
        assert status == 429 and err["error"]["code"] == "held_bytes_exceeded", err
        # another tenant still queues within its own share, and is served
        other = asyncio.create_task(send(http, gw.url, "b", padded(3, pad)))
        await wait_for(queued(2), what="b's body queued")
        holder.cancel()  # the held request's client leaves: its slot frees
        await asyncio.gather(holder, return_exceptions=True)
        assert [(await first)[0], (await other)[0]] == [200, 200]
    assert held.held == 0  # every charge given back
