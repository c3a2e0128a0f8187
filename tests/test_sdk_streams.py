"""The official SDKs' stream helpers through the gateway, against the simulated replica whose
streams are vLLM 0.34's event for event: ``client.responses.stream()`` (what the Agents SDK
uses) and ``client.chat.completions.stream()``; and vLLM's --enable-force-include-usage."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from loadtest.sim.config import SimConfig
from tests.helpers import LONG_SYSTEM

MODEL = "Qwen/Qwen3-0.6B"
# vLLM 0.34's simple Responses stream (responses/serving.py responses_stream_generator around
# streaming_events.py emit_simple_content_open / _delta / _done).
OPEN = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_responses_stream_helper(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    client = client_for(gw.url)
    kinds: list[str] = []
    numbers: list[int] = []
    deltas: list[str] = []
    async with client.responses.stream(
        model=MODEL, instructions=LONG_SYSTEM, input="Tell me something."
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    await client.close()
    n = len(deltas)
    assert n > 0
    assert kinds == OPEN + ["response.output_text.delta"] * n + CLOSE + ["response.completed"]
    assert numbers == list(range(len(kinds)))
    assert final.status == "completed"  # no token limit: the answer ended on its own
    assert final.output_text == "".join(deltas)
    assert final.usage is not None and final.usage.output_tokens == n


async def test_responses_stream_cut_by_its_token_limit_ends_incomplete(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    """As vLLM: a max_output_tokens cut ends in response.incomplete, and the helper
    accumulates the text without an IndexError."""
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    client = client_for(gw.url)
    terminal = None
    async with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=3) as stream:
        async for event in stream:
            if event.type == "response.output_text.done":
                text = event.text
            terminal = event
    await client.close()
    assert terminal is not None and terminal.type == "response.incomplete"
    response = terminal.response  # type: ignore[union-attr]
    assert response.status == "incomplete" and response.output_text == text
    assert response.incomplete_details.reason == "max_output_tokens"


async def test_chat_stream_helper(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    client = client_for(gw.url)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi"}]
    pieces: list[str] = []
    async with client.chat.completions.stream(
        model=MODEL, messages=messages, stream_options={"include_usage": True}
    ) as stream:
        async for event in stream:
            if event.type == "content.delta":
                pieces.append(event.delta)
        final = await stream.get_final_completion()
    assert final.choices[0].message.content == "".join(pieces) != ""
    assert final.choices[0].finish_reason == "stop"
    # The role chunk's "" delta, then one per token.
    assert final.usage is not None and final.usage.completion_tokens == len(pieces) - 1
    # A token limit that cuts the answer: vLLM says "length", and the helper raises for it.
    with pytest.raises(openai.LengthFinishReasonError):
        async with client.chat.completions.stream(
            model=MODEL, messages=messages, max_tokens=3
        ) as stream:
            await stream.get_final_completion()
    await client.close()


async def test_chat_chunks_are_vllms(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    """The raw chunks carry vLLM 0.34's fields in its order (exclude_unset serialization)."""
    (replica,) = await fleet(1)
    gw = await gateway([replica.url])
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=body) as r,
    ):
        raw = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    head = ["id", "object", "created", "model", "choices"]
    assert list(chunks[0]) == [*head, "prompt_token_ids", "prompt_text"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [list(c) for c in chunks[1:4]] == [[*head, "kv_transfer_params"]] * 3
    assert list(chunks[1]["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "token_ids",
    ]
    assert list(chunks[3]["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "weight_versions",
    ]
    assert list(chunks[4]) == [*head, "usage"] and chunks[4]["choices"] == []


async def test_force_include_usage(fleet, gateway) -> None:  # type: ignore[no-untyped-def]
    """vLLM's --enable-force-include-usage: a stream that did not ask carries usage on each
    chunk and ends with a usage chunk; the chat helper's final completion has it."""
    (replica,) = await fleet(1, enable_force_include_usage=True)
    gw = await gateway([replica.url])
    client = client_for(gw.url)
    chunks = []
    async for chunk in await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    ):
        chunks.append(chunk)
    async with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        final = await stream.get_final_completion()
    await client.close()
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 3, 4, 4]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details is not None
    assert (
        final.usage is not None and final.usage.completion_tokens == SimConfig().max_tokens_default
    )
