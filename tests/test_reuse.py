"""The three reuse numbers per model and tenant on /metrics (router/routing/reuse.py): available
(the longest prefix any replica held), captured (what the chosen replica held), delivered
(the cached tokens the replica reported), checked against what each answer says: its
``x-prefix-router-cached-blocks`` header (captured) and its usage (prompt and delivered)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import aiohttp

from router.telemetry import exposition
from tests.helpers import chat_body, post

BS = 16
MODEL = "Qwen/Qwen3-0.6B"
ADMIN = {"X-Admin-Key": "k"}


async def reuse_metrics(session: aiohttp.ClientSession, url: str) -> dict[tuple, float]:
    async with session.get(url + "/metrics") as r:
        page = await r.text()
    out = {}
    for name, raw, value in exposition.samples(page, "prefix_router_reuse_"):
        if name.endswith("_total"):
            lab = exposition.labels(raw)
            stage = name.removeprefix("prefix_router_reuse_").removesuffix("_tokens_total")
            out[(lab["model"], lab["tenant"], stage)] = value
    return out


async def test_available_captured_and_delivered_per_model_and_tenant(fleet, gateway):
    # Slow answers: requests of one prompt sent together pile up on its holder until the
    # policy's load bound sends one to the other replica, where the prefix is available but
    # not captured.
    replicas = await fleet(2, decode_tokens_per_s=20.0, lora_adapters=["ad1"])
    gw = await gateway(
        [r.url for r in replicas], policy="ttft", tenant_header="x-tenant", admin_key="k"
    )
    want: dict[tuple, float] = defaultdict(float)
    shares: list[tuple[str, str, int, int]] = []  # model, tenant, captured, available

    async def send(body: dict[str, Any], tenant: str, available_blocks: int) -> None:
        status, h, answer = await post(
            s, gw.url + "/v1/chat/completions", body, headers={"x-tenant": tenant}
        )
        assert status == 200, answer
        usage = answer["usage"]
        key = (body["model"], tenant)
        captured = int(h["x-prefix-router-cached-blocks"]) * BS
        want[(*key, "prompt")] += usage["prompt_tokens"]
        want[(*key, "captured")] += captured
        want[(*key, "delivered")] += usage["prompt_tokens_details"]["cached_tokens"]
        available = available_blocks * BS
        want[(*key, "available")] += available
        shares.append((*key, captured, available))

    base = chat_body("a question", max_tokens=2)
    slow = {**base, "max_tokens": 20}  # a second in flight
    adapter = {**base, "model": "ad1"}
    async with aiohttp.ClientSession() as s:
        status, _, ex = await post(s, gw.url + "/v1/route/explain", base, headers=ADMIN)
        assert status == 200 and ex["decision"]["reuse"]["available_tokens"] == 0
        held = ex["cacheable_blocks"]
        await send(base, "acme", 0)  # cold: nothing available
        status, _, ex = await post(s, gw.url + "/v1/route/explain", base, headers=ADMIN)
        reuse = ex["decision"]["reuse"]
        assert reuse == {
            "available_tokens": held * BS,
            "captured_tokens": held * BS,
            "delivered_tokens": None,
        }
        # Every one of these finds the prefix held (recorded when the first was sent).
        await asyncio.gather(*(send(slow, "acme", held) for _ in range(12)))
        await send(base, "globex", held)
        await send(adapter, "acme", 0)  # an adapter's blocks are its own
        await send(adapter, "acme", held)
        got = await reuse_metrics(s, gw.url)
        async with s.get(
            gw.url + "/admin/diagnostics", params={"model": MODEL}, headers=ADMIN
        ) as r:
            assert r.status == 200
            diagnosed = (await r.json())["hit_rates"]
    assert got == dict(want)
    # Diagnose says the same, in the same words: each number over the model's prompt tokens.
    prompt = got[(MODEL, "acme", "prompt")] + got[(MODEL, "globex", "prompt")]
    for stage in ("available", "captured", "delivered"):
        total = got[(MODEL, "acme", stage)] + got[(MODEL, "globex", stage)]
        assert diagnosed[stage] == round(total / prompt, 4), stage
    # The numbers differ where they should: some requests went where the prefix was not.
    assert any(c < a for m, _, c, a in shares if m == MODEL), shares
    assert got[(MODEL, "globex", "available")] > 0 and got[("ad1", "acme", "delivered")] > 0
