"""End-to-end: OpenAI clients -> gateway -> simulated vLLM replicas, all over real sockets."""

from __future__ import annotations

import asyncio
import collections
import json

import aiohttp
import pytest

from tests.helpers import LONG_SYSTEM, cached_tokens, chat_body, post, replica_stats, wait_for

REPLICA_HDR = "x-prefix-router-replica"
BLOCKS_HDR = "x-prefix-router-cached-blocks"


async def test_chat_roundtrip_headers_and_usage(fleet, gateway):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(
            s, gw.url + "/v1/chat/completions", chat_body("hello"), {"x-request-id": "abc-123"}
        )
    assert status == 200, body
    assert headers["x-request-id"] == "abc-123"
    assert headers[REPLICA_HDR] in {r.url for r in replicas}
    assert headers[BLOCKS_HDR] == "0"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] > 100


async def test_completions_string_and_token_ids(fleet, gateway, renderer):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    ids = renderer.tokenize_completion("The quick brown fox " * 20)
    async with aiohttp.ClientSession() as s:
        status, h1, body = await post(
            s, gw.url + "/v1/completions", {"prompt": "The quick brown fox " * 20, "max_tokens": 3}
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(ids)
        status, h2, body = await post(
            s, gw.url + "/v1/completions", {"prompt": ids, "max_tokens": 3}
        )
        assert status == 200, body
    # Same tokens, same blocks: the token-id request follows the string one and hits.
    assert h2[REPLICA_HDR] == h1[REPLICA_HDR]
    assert int(h2[BLOCKS_HDR]) == (len(ids) - 1) // 16
    assert cached_tokens(body) == int(h2[BLOCKS_HDR]) * 16


async def test_streaming_passes_events_through(fleet, gateway):
    replicas = await fleet(1, max_tokens_default=8)
    gw = await gateway([replicas[0].url])
    body = chat_body(
        "stream please", stream=True, max_tokens=6, stream_options={"include_usage": True}
    )

    async def events(url):
        out = []
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for line in resp.content:
                if line.startswith(b"data: "):
                    out.append(line[6:].strip())
        return out

    direct = await events(replicas[0].url + "/v1/chat/completions")
    via_gateway = await events(gw.url + "/v1/chat/completions")
    assert via_gateway[-1] == b"[DONE]"
    assert len(via_gateway) == len(direct)
    usage = json.loads(via_gateway[-2])["usage"]
    assert usage["completion_tokens"] == 6
    # The second request hit the first one's prefix: the relayed usage says so.
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_openai_client_against_gateway(fleet, gateway):
    openai = pytest.importorskip("openai")
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["Qwen/Qwen3-0.6B"]
        reply = await client.chat.completions.create(
            model="Qwen/Qwen3-0.6B",
            max_tokens=4,
            messages=[
                {"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "Hi"},
            ],
        )
        assert reply.choices[0].message.content
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="Qwen/Qwen3-0.6B",
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                messages=[
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "Hi again"},
                ],
            )
        ]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="Qwen/Qwen3-0.6B", messages="nope")
        assert err.value.body["param"] == "messages"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        await client.close()


async def test_same_prefix_sticks_and_hits(fleet, gateway):
    replicas = await fleet(4)
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        seen = []
        for i in range(8):
            status, headers, body = await post(
                s, gw.url + "/v1/chat/completions", chat_body(f"question number {i}")
            )
            assert status == 200
            seen.append((headers[REPLICA_HDR], int(headers[BLOCKS_HDR]), cached_tokens(body)))
    assert len({r for r, _, _ in seen}) == 1, seen
    for _, predicted, reported in seen[1:]:
        assert predicted > 0
        assert reported == predicted * 16  # the prediction is exactly what vLLM reused


async def test_new_prefixes_spread_over_the_ring(fleet, gateway):
    replicas = await fleet(4)
    gw = await gateway([r.url for r in replicas])
    counts: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as s:
        for i in range(40):  # concurrency 1: no load signal at all, only the ring
            status, headers, _ = await post(
                s,
                gw.url + "/v1/chat/completions",
                chat_body("hi", system=f"Tenant {i} system prompt. " + LONG_SYSTEM),
            )
            assert status == 200
            counts[headers[REPLICA_HDR]] += 1
    assert len(counts) == 4, counts
    assert max(counts.values()) <= 20, counts


def _tenant(i: int, question: str = "hi") -> dict:
    return chat_body(question, system=f"Tenant {i} system prompt. " + LONG_SYSTEM)


async def _idle(gw) -> None:
    """Nothing in flight anywhere: the load counters back at zero after the last answer."""

    async def idle() -> bool:
        return all(r.inflight == 0 for r in gw.gateway.fleet.replicas.values())

    await wait_for(idle, what="nothing in flight")


async def test_a_new_prefix_goes_where_the_least_traffic_went_lately_not_its_ring_owner(
    fleet, gateway
):
    """Two replicas, nothing queued or in flight (queues and in-flight counts tie): tenant 0
    sent eight requests to its replica lately, the other replica none. A new tenant whose ring
    owner is that busy replica lands on the other one (by ring order it would land beside
    tenant 0: a first, uncached prefill in front of tenant 0's next requests)."""
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        for i in range(8):
            status, headers, _ = await post(
                s, gw.url + "/v1/chat/completions", _tenant(0, f"question {i}")
            )
            assert status == 200
        busy = headers[REPLICA_HDR]
        other = next(r for r in replicas if r.url != busy)
        await _idle(gw)
        for i in range(1, 40):  # a tenant whose prefix the ring gives to the busy replica
            _, _, ex = await post(s, gw.url + "/v1/route/explain", _tenant(i))
            if ex["decision"]["ring_choice"] == busy:
                break
        else:
            raise AssertionError("no tenant's ring owner is the busy replica")
        assert ex["decision"]["reason"] == "ring"
        body = {**_tenant(i), "max_tokens": 4}
        status, headers, _ = await post(
            s, gw.url + "/v1/chat/completions", body, {"x-request-id": "new-tenant"}
        )
    assert status == 200
    assert headers[REPLICA_HDR] == other.url
    # The replicas' own records: the new tenant's request reached the other replica only.
    ids = {r.url: [x["request_id"] for x in r.stats["records"]] for r in replicas}
    assert any(i.endswith("new-tenant") for i in ids[other.url]), ids
    assert not any(i.endswith("new-tenant") for i in ids[busy]), ids


async def test_hot_prefix_spills_to_a_second_replica(fleet, gateway):
    # Slow prefill so a burst of the same prefix backs up on its home replica.
    replicas = await fleet(4, prefill_tokens_per_s=20_000, decode_tokens_per_s=200)
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        await post(s, gw.url + "/v1/chat/completions", chat_body("warm up"))
        results = await asyncio.gather(
            *(
                post(s, gw.url + "/v1/chat/completions", chat_body(f"burst {i}", max_tokens=8))
                for i in range(32)
            )
        )
    used = collections.Counter(h[REPLICA_HDR] for _, h, _ in results)
    assert all(status == 200 for status, _, _ in results)
    assert len(used) >= 2, used
    assert max(used.values()) < 32
    # Most of the burst still rides the cache: spilling is the exception, not the rule.
    hits = sum(1 for _, _, b in results if cached_tokens(b) > 0)
    assert hits >= 16


async def test_replica_killed_mid_run_loses_no_request(fleet, gateway):
    """The requests in flight on a replica that dies fail over whatever the retry budget:
    the replica dropped their connections, so none is computed twice (here the budget allows
    no retry at all)."""
    replicas = await fleet(3, prefill_tokens_per_s=50_000)
    gw = await gateway(
        [r.url for r in replicas],
        eject_after_failures=1,
        retry_budget_percent=0,
        retry_budget_min_concurrency=0,
    )
    victim = replicas[0]

    async def one(s, i):
        return await post(
            s,
            gw.url + "/v1/chat/completions",
            chat_body("q", system=f"Conversation {i}. " + LONG_SYSTEM),
        )

    async with aiohttp.ClientSession() as s:
        first = [asyncio.create_task(one(s, i)) for i in range(30)]
        await wait_for(lambda: _inflight_on(gw, victim.url), what="traffic on the victim")
        await victim.stop()
        rest = [asyncio.create_task(one(s, 100 + i)) for i in range(30)]
        results = await asyncio.gather(*first, *rest)
    statuses = collections.Counter(status for status, _, _ in results)
    assert statuses == {200: 60}, statuses
    assert all(h[REPLICA_HDR] != victim.url for _, h, _ in results[30:])


async def _inflight_on(gw, url):
    return gw.gateway.fleet.replicas[url].inflight > 0


async def test_retry_on_503_and_passthrough_of_other_errors(fleet, gateway):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], eject_after_failures=5)
    async with aiohttp.ClientSession() as s:
        _, h, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("first"))
        home = next(r for r in replicas if r.url == h[REPLICA_HDR])
        home.fail_next(1, status=503)
        status, h2, body = await post(s, gw.url + "/v1/chat/completions", chat_body("again"))
        assert status == 200, body
        assert h2[REPLICA_HDR] != home.url  # retried on the other replica
        # A 4xx from the replica reaches the client unchanged.
        direct = await post(s, home.url + "/v1/chat/completions", chat_body("x", cache_salt=""))
        via = await post(
            s,
            gw.url + "/v1/completions",
            {"prompt": "hi", "max_tokens": 1, "cache_salt": "x" * 129},
        )
        assert via[0] == 400 and via[2]["error"]["param"] == "cache_salt"
        assert direct[0] == 400


@pytest.mark.parametrize(
    "raw,param",
    [
        (b"{not json", None),
        (b"[1, 2, 3]", None),
        (b"", None),
        (b'{"messages": "hello"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "no role"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "model": 7}', "model"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": 12}]}', None),
        (b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"}', "cache_salt"),
        (b"\xff\xfe", None),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # hostile nesting
    ],
)
async def test_malformed_bodies_get_openai_4xx(fleet, gateway, raw, param):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(s, gw.url + "/v1/chat/completions", raw)
        assert 400 <= status < 500, body
        assert set(body["error"]) >= {"message", "type", "param", "code"}
        if param:
            assert body["error"]["param"] == param
        assert "x-request-id" in headers
        ok = await post(s, gw.url + "/v1/chat/completions", chat_body("still serving"))
        assert ok[0] == 200


async def test_limits_and_unknown_routes(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_body_bytes=10_000)
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, gw.url + "/v1/chat/completions", chat_body("x" * 20_000))
        assert status == 413 and "error" in body
        async with s.get(gw.url + "/v1/nothing-here") as resp:
            assert resp.status == 404
            assert "error" in await resp.json()
        async with s.get(gw.url + "/v1/chat/completions") as resp:
            assert resp.status == 405
            assert "error" in await resp.json()


async def test_unknown_fields_are_forwarded(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        # vLLM-specific fields the gateway does not know must reach the replica: an invalid
        # value for one is rejected *by the replica*, proving it arrived.
        status, _, body = await post(
            s, gw.url + "/v1/chat/completions", chat_body("x", my_custom_field={"a": 1})
        )
        assert status == 200, body


async def test_models_health_ready_metrics(fleet, gateway):
    replicas = await fleet(2, lora_adapters=["support-lora"])
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models") as resp:
            ids = sorted(m["id"] for m in (await resp.json())["data"])
        assert ids == ["Qwen/Qwen3-0.6B", "support-lora"]
        async with s.get(gw.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(gw.url + "/ready") as resp:
            assert resp.status == 200
        await post(s, gw.url + "/v1/chat/completions", chat_body("m"))
        async with s.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert (
            'prefix_router_requests_total{outcome="ok",policy="ring_spill"' in text
        )  # the default
        assert "prefix_router_tokenize_seconds_bucket" in text
        for r in replicas:
            r.health_status = 503

        async def not_ready():
            async with s.get(gw.url + "/ready") as resp:
                return resp.status == 503

        await wait_for(not_ready, what="/ready to turn 503")
        status, _, body = await post(s, gw.url + "/v1/chat/completions", chat_body("m"))
        assert status == 503 and body["error"]["code"] == "no_replica"


async def test_lora_adapter_never_shares_with_base(fleet, gateway):
    replicas = await fleet(1, lora_adapters=["support-lora"])
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        await post(s, gw.url + "/v1/chat/completions", chat_body("base"))
        status, h, body = await post(
            s, gw.url + "/v1/chat/completions", {**chat_body("base"), "model": "support-lora"}
        )
        assert status == 200
        assert h[BLOCKS_HDR] == "0" and cached_tokens(body) == 0
        status, h, body = await post(
            s, gw.url + "/v1/chat/completions", {**chat_body("base 2"), "model": "support-lora"}
        )
        assert int(h[BLOCKS_HDR]) > 0 and cached_tokens(body) == int(h[BLOCKS_HDR]) * 16


async def test_index_corrects_after_replica_cache_loss(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    other = chat_body("other", system="A different prompt entirely. " + LONG_SYSTEM)
    third = chat_body("third", system="A third prompt, unlike the others. " + LONG_SYSTEM)
    async with aiohttp.ClientSession() as s:
        await post(s, gw.url + "/v1/chat/completions", chat_body("one"))
        await post(s, gw.url + "/v1/chat/completions", third)
        await post(s, gw.url + "/v1/chat/completions", other)
        index = gw.gateway.index
        before = index.size(replicas[0].url)
        replicas[0].reset_cache()
        # Stale predictions on three different prompts (one is not evidence enough:
        # router/fleet/cache_loss.py) ...
        for body in (chat_body("two"), third):
            _, h, answer = await post(s, gw.url + "/v1/chat/completions", body)
            assert int(h[BLOCKS_HDR]) > 0 and cached_tokens(answer) == 0
            assert index.size(replicas[0].url) >= before
        _, h, answer = await post(s, gw.url + "/v1/chat/completions", chat_body("four"))
        assert int(h[BLOCKS_HDR]) > 0 and cached_tokens(answer) > 0  # "two" re-cached it
        _, h, answer = await post(s, gw.url + "/v1/chat/completions", other)
        assert int(h[BLOCKS_HDR]) > 0 and cached_tokens(answer) == 0

        async def forgotten():
            return index.size(replicas[0].url) < before

        await wait_for(forgotten, what="the index to drop the lost blocks")
        _, h, _ = await post(s, gw.url + "/v1/chat/completions", third)
        assert h[BLOCKS_HDR] == "0"  # ...corrected: the third prefix is no longer assumed


async def test_client_disconnect_cancels_upstream(fleet, gateway):
    replicas = await fleet(1, decode_tokens_per_s=20)
    gw = await gateway([replicas[0].url])
    body = chat_body("long answer", stream=True, max_tokens=200)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            stats = await replica_stats(s, replicas[0].url)
            assert stats.running == 1
        # The client left; the replica must see its request end.

        async def idle():
            return (await replica_stats(s, replicas[0].url)).running == 0

        await wait_for(idle, what="the upstream request to be cancelled")
