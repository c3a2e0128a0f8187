"""A client pointed at the wrong base path gets a 404 in its API's shape naming the path it
meant: an OpenAI client without /v1, an Anthropic client with it."""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest


async def test_openai_client_without_v1(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(
            model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    message = e.value.body["message"]  # type: ignore[index]
    assert "POST /chat/completions; did you mean /v1/chat/completions?" in message
    assert f'base_url="{gw.url}/v1"' in message
    assert e.value.code == "wrong_base_path"
    with pytest.raises(openai.NotFoundError, match="did you mean /v1/models"):
        await client.models.list()
    await client.close()


async def test_anthropic_client_with_v1(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    client = anthropic.AsyncAnthropic(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(
            model="Qwen/Qwen3-0.6B", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "not_found_error"
    message = body["error"]["message"]
    assert "POST /v1/v1/messages; did you mean /v1/messages?" in message
    assert f'base_url="{gw.url}"' in message
    await client.close()


async def test_other_unknown_paths_stay_a_plain_404(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    async with aiohttp.ClientSession() as s:
        for method, path in [
            ("POST", "/nope"),
            ("GET", "/v1/v1/nope"),
            ("GET", "/chat/completions"),
        ]:
            async with s.request(method, gw.url + path) as r:
                body = await r.json()
            assert r.status in (404, 405), (path, r.status)
            assert "did you mean" not in body["error"]["message"], (path, body)
