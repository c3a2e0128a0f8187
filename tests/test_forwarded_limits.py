"""Forwarded endpoints (pooling, scoring, reranking, audio, tokenize, detokenize,
count_tokens) count against their tenant's rate limits, and those that run the model take a
prefill slot from flow control as generation requests do, over real sockets. The simulated
replica answers /tokenize, /detokenize and count_tokens, and 404 for the pooling endpoints it
lacks: a 404 relayed from the replica was forwarded, a 429 was refused by the gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.helpers import chat_body, post, wait_for

MODEL = "Qwen/Qwen3-0.6B"
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"model": MODEL, "input": "some text"}),
    ("/tokenize", {"model": MODEL, "prompt": "some text"}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
    ("/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
    ("/pooling", {"model": MODEL, "input": "x"}),
    ("/classify", {"model": MODEL, "input": "x"}),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
]


async def test_a_5_rpm_tenant_is_refused_on_forwarded_endpoints_past_5(fleet, gateway) -> None:
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url], tenant_header="X-Tenant", tenants={"metered": {"rpm": 5}, "free": {}}
    )
    statuses = []
    async with aiohttp.ClientSession() as http:
        for path, body in REQUESTS:
            status, headers, err = await post(http, gw.url + path, body, {"X-Tenant": "metered"})
            statuses.append(status)
            if status == 429:
                assert int(headers["Retry-After"]) >= 1
                shape = err["error"]["type"] if path.startswith("/v1/messages") else err["error"]
                assert shape == "rate_limit_error" or shape["code"] == "rate_limit_exceeded", err
        free = [
            (await post(http, gw.url + path, body, {"X-Tenant": "free"}))[0]
            for path, body in REQUESTS
        ]
    assert 429 not in statuses[:5] and statuses[5:] == [429] * 3, statuses
    assert 429 not in free, free


async def test_pooling_requests_wait_for_a_prefill_slot(fleet, gateway) -> None:
    """With flow control on and the fleet's one slot held (by another tenant: tenants
    contend), an embeddings request waits in the gateway's queue, and is forwarded once the
    slot frees."""
    (replica,) = await fleet(1)
    gw = await gateway([replica.url], flow_control=True, tenant_header="X-Tenant")
    flow = gw.gateway.flow
    async with aiohttp.ClientSession() as http:
        replica.hang_next(1)
        held = asyncio.create_task(
            post(http, gw.url + "/v1/chat/completions", chat_body("hi"), {"X-Tenant": "a"})
        )

        async def hanging() -> bool:
            return replica.hanging == 1

        await wait_for(hanging, what="the held request at the replica")
        pooled = asyncio.create_task(
            post(http, gw.url + "/v1/embeddings", REQUESTS[0][1], {"X-Tenant": "b"})
        )

        async def queued() -> bool:
            return sum(q.size for q in flow.queues.values()) == 1

        await wait_for(queued, what="the embeddings request queued")
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        status, _, _ = await pooled
    assert status == 404  # forwarded once released: the simulator has no embeddings
    assert flow.in_prefill(MODEL) == 0
