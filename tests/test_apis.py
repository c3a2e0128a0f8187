"""The Anthropic Messages and OpenAI Responses APIs, and the forwarded vLLM endpoints:
official SDKs -> gateway -> simulated vLLM replicas, over real sockets."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from router.api import anthropic as anthropic_api
from router.api import responses as responses_api
from router.api.convert import to_chat
from tests.helpers import LONG_SYSTEM, post

MODEL = "Qwen/Qwen3-0.6B"
REPLICA_HDR = "x-prefix-router-replica"
BLOCKS_HDR = "x-prefix-router-cached-blocks"


def _anthropic_client(url: str):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def _openai_client(url: str):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_messages_create_and_stream_follow_the_prefix(fleet, gateway):
    replicas = await fleet(3)
    gw = await gateway([r.url for r in replicas])
    client = _anthropic_client(gw.url)
    try:
        first = await client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=[{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Hello"}],
        )
        msg = await first.parse()
        assert msg.type == "message" and msg.content[0].text
        assert msg.usage.input_tokens > 100
        placed = first.headers[REPLICA_HDR]
        second = await client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=LONG_SYSTEM,  # a string and one text block render alike
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi again"}]}],
        )
        assert second.headers[REPLICA_HDR] == placed
        assert int(second.headers[BLOCKS_HDR]) > 0
        assert (await second.parse()).usage.cache_read_input_tokens == int(
            second.headers[BLOCKS_HDR]
        ) * 16
        events = []
        async with client.messages.stream(
            model=MODEL,
            max_tokens=5,
            system=LONG_SYSTEM,
            messages=[{"role": "user", "content": "Stream it"}],
        ) as stream:
            async for ev in stream:
                events.append(ev.type)
            final = await stream.get_final_message()
        assert events[0] == "message_start" and "content_block_delta" in events
        assert events[-1] == "message_stop"
        assert final.usage.output_tokens == 5
        assert final.usage.cache_read_input_tokens > 0
    finally:
        await client.close()
    # The gateway learnt the reported cached tokens (Anthropic's cache_read_input_tokens).
    assert gw.gateway.metrics.reported_cached_tokens.labels("default").value > 0


async def test_responses_create_stream_and_previous_response_id(fleet, gateway):
    replicas = await fleet(3)
    gw = await gateway([r.url for r in replicas])
    client = _openai_client(gw.url)
    try:
        raw = await client.responses.with_raw_response.create(
            model=MODEL, instructions=LONG_SYSTEM, input="Hello", max_output_tokens=4
        )
        first = raw.parse()
        assert first.output_text and first.usage.input_tokens > 100
        placed = raw.headers[REPLICA_HDR]
        again = await client.responses.with_raw_response.create(
            model=MODEL,
            instructions=LONG_SYSTEM,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi again"}]}],
            max_output_tokens=4,
        )
        assert again.headers[REPLICA_HDR] == placed
        assert again.parse().usage.input_tokens_details.cached_tokens > 0
        kinds = []
        completed = None
        async for ev in await client.responses.create(
            model=MODEL,
            instructions=LONG_SYSTEM,
            input="Stream it",
            max_output_tokens=5,
            stream=True,
        ):
            kinds.append(ev.type)
            if ev.type in ("response.completed", "response.incomplete"):  # 5 tokens: cut
                completed = ev.response
        assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
        assert completed is not None and completed.usage.input_tokens_details.cached_tokens > 0
        # A follow-up naming a stored response reaches the replica that stored it, even with
        # no shared prefix to route on (the conversation lives on that replica).
        for _ in range(3):
            follow = await client.responses.with_raw_response.create(
                model=MODEL,
                previous_response_id=completed.id,
                input="And then?",
                max_output_tokens=3,
            )
            assert follow.headers[REPLICA_HDR] == placed
            assert follow.parse().output_text
    finally:
        await client.close()


async def test_previous_response_on_an_unknown_id_is_vllms_404(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(
            s,
            gw.url + "/v1/responses",
            {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"},
        )
    assert status == 404
    assert "resp_nope" in body["error"]["message"]


async def test_bad_messages_bodies_get_anthropic_errors(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    bad = [
        b"{not json",
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 7}]},
        {
            "model": MODEL,
            "max_tokens": 4,
            "tool_choice": {"type": "sometimes"},
            "messages": [{"role": "user", "content": "x"}],
        },
        {
            "model": MODEL,
            "max_tokens": 4,
            "cache_salt": "a/b",
            "messages": [{"role": "user", "content": "x"}],
        },
    ]
    async with aiohttp.ClientSession() as s:
        for body in bad:
            status, _, got = await post(s, gw.url + "/v1/messages", body)
            assert status == 400, (body, got)
            assert got["type"] == "error", got
            assert got["error"]["type"] == "invalid_request_error"
            assert got["error"]["message"]
        status, _, got = await post(
            s,
            gw.url + "/v1/messages",
            {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 404 and got["error"]["type"] == "not_found_error"


async def test_bad_responses_bodies_get_openai_errors(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    bad = [
        b"[]",
        {"model": MODEL},
        {"model": MODEL, "input": []},
        {"model": MODEL, "input": "x", "instructions": 3},
        {"model": MODEL, "input": [7]},
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
            ],
        },
        {"model": MODEL, "input": "x", "max_output_tokens": -1},
    ]
    async with aiohttp.ClientSession() as s:
        for body in bad:
            status, _, got = await post(s, gw.url + "/v1/responses", body)
            assert status == 400, (body, got)
            assert set(got["error"]) >= {"message", "type", "param", "code"}, got


async def test_count_tokens_and_forwarded_endpoints(fleet, gateway, renderer):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    expected = len(renderer.chat_ids(anthropic_api.to_chat(body, count_tokens=True)))
    async with aiohttp.ClientSession() as s:
        status, headers, got = await post(s, gw.url + "/v1/messages/count_tokens", body)
        assert status == 200, got
        assert got == {"input_tokens": expected}
        assert headers["x-request-id"]
        status, _, got = await post(s, gw.url + "/v1/messages/count_tokens", {"model": MODEL})
        assert status == 400 and got["type"] == "error"
        async with s.get(gw.url + "/version") as resp:
            assert resp.status == 200
            assert "version" in await resp.json()
        # A vLLM endpoint this simulator lacks is forwarded, and the replica's 404 relayed.
        status, _, got = await post(s, gw.url + "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert status == 404
        status, _, got = await post(s, gw.url + "/v1/embeddings", {"model": "nope", "input": "x"})
        assert status == 404 and got["error"]["code"] == "model_not_found"
        status, _, got = await post(s, gw.url + "/v1/nothing-here", {})
        assert status == 404 and got["error"]["message"]
        async with s.get(gw.url + "/v1/messages") as resp:
            assert resp.status == 405
            assert (await resp.json())["error"]["type"]


def test_converters_match_vllm_on_tool_use_and_thinking():
    """The shapes vLLM's own conversion produces (vllm/entrypoints/anthropic/serving.py,
    vllm/entrypoints/openai/responses/utils.py), pinned on a multi-turn tool conversation."""
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: abc"},
            {"type": "text", "text": "Sys A. ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Sys B."},
        ],
        "tools": [{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "cold"}],
                    }
                ],
            },
        ],
    }
    chat = anthropic_api.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Sys A. Sys B."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "content": "calling",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "cold"},
    ]
    assert chat["tools"][0]["function"] == {
        "name": "get",
        "description": "d",
        "parameters": {"type": "object"},
    }
    assert chat["tool_choice"] == "auto"
    rbody = {
        "model": MODEL,
        "instructions": "Be terse.",
        "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": "weather?"},
            {
                "type": "reasoning",
                "id": "rs1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hmm"}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "cold"},
        ],
    }
    rchat = responses_api.to_chat(rbody)
    assert rchat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "c1",
                    "function": {"name": "get", "arguments": '{"city":"Oslo"}'},
                    "type": "function",
                }
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]
    assert rchat["tools"] == [
        {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    ]


async def test_previous_response_id_reaches_its_replica_via_another_gateway(
    fleet, gateway, redis_server
):
    from router.index.redis import make_client
    from tests.helpers import wait_for

    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    g1 = await gateway(urls, redis_url=redis_server.url)
    g2 = await gateway(urls, redis_url=redis_server.url)
    rclient = make_client(redis_server.url, socket_timeout=2.0, connect_timeout=1.0)
    async with aiohttp.ClientSession() as s:
        try:
            status, h1, first = await post(
                s,
                g1.url + "/v1/responses",
                {"model": MODEL, "input": "Hello", "max_output_tokens": 3},
            )
            assert status == 200, first
            key = f"{g1.gateway.config.fleet.redis_prefix}:resp:{first['id']}"

            async def shared() -> bool:
                return await rclient.get(key) is not None

            await wait_for(shared, what="the response id in Redis")
            for _ in range(3):
                status, h2, body = await post(
                    s,
                    g2.url + "/v1/responses",
                    {"model": MODEL, "previous_response_id": first["id"], "input": "More?"},
                )
                assert status == 200, body
                assert h2[REPLICA_HDR] == h1[REPLICA_HDR]
        finally:
            await rclient.aclose()


async def test_explain_accepts_messages_and_responses_bodies(fleet, gateway, renderer):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    mbody = {
        "model": MODEL,
        "max_tokens": 4,
        "system": LONG_SYSTEM,
        "messages": [{"role": "user", "content": "x"}],
    }
    rbody = {"model": MODEL, "instructions": LONG_SYSTEM, "input": "x"}
    async with aiohttp.ClientSession() as s:
        status, _, m = await post(
            s, gw.url + "/v1/route/explain?endpoint=messages&token_ids=1", mbody
        )
        assert status == 200, m
        status, _, r = await post(s, gw.url + "/v1/route/explain?token_ids=1", rbody)
        assert status == 200, r
    assert m["endpoint"] == "messages" and r["endpoint"] == "responses"
    # Same system text and user turn: the two APIs render the same prompt.
    assert m["token_ids"] == r["token_ids"] == list(renderer.chat_ids(anthropic_api.to_chat(mbody)))


# Anthropic and Responses bodies with the ids vLLM 0.34.0 computes for them: vLLM's own
# converters and renderer, run by tools/make_api_fixtures.py in the oracle's venv.
API_FIXTURE = Path(__file__).parent / "data" / "api_oracle_cases.jsonl"
API_CASES = [json.loads(line) for line in API_FIXTURE.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c["id"])
def test_converted_bodies_render_as_vllm_does(case, renderer):
    assert "token_ids" in case["expected"], case["expected"]
    chat = to_chat(case["api"], case["body"])
    assert list(renderer.chat_ids(chat)) == case["expected"]["token_ids"]
