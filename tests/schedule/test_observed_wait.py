"""Over HTTP: the gateway feeds a replica's observed time to first byte (ring_spill's ttft
cap) only from streamed answers of mostly cached prompts, and its metrics and explain show
the prefix's replica set."""

from __future__ import annotations

import aiohttp

from router.schedule.observed import MAX_UNCACHED_TOKENS
from tests.helpers import LONG_SYSTEM, chat_body, post, wait_for


async def _stream(s: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        await resp.read()


async def test_only_streamed_mostly_cached_answers_are_wait_samples(fleet, gateway):
    (replica,) = await fleet(1)
    running = await gateway([replica.url], policy="ring_spill")
    state = running.gateway.fleet.replicas[replica.url]
    system = LONG_SYSTEM * 4
    async with aiohttp.ClientSession() as s:
        # First contact: the whole long prompt is uncached, its time is its own prefill.
        await _stream(s, running.url, chat_body("first", system=system))
        assert state.ttft.samples == 0
        # Now the system prompt is held: the next one's first byte measures the wait.
        await _stream(s, running.url, chat_body("second", system=system))
        await wait_for(
            lambda: _true(state.ttft.samples == 1), what="the cached answer to be observed"
        )
        assert state.ttft.get() > 0
        # A whole (non-streamed) answer is not a time to first token.
        status, _, _ = await post(s, running.url + "/v1/chat/completions", chat_body("third"))
        assert status == 200
        async with s.get(running.url + "/metrics") as resp:
            text = await resp.text()
        assert state.ttft.samples == 1
        assert 'prefix_router_prefix_replicas_count{policy="ring_spill"}' in text
        body = {**chat_body("fourth", system=system)}
        status, _, explained = await post(s, running.url + "/v1/route/explain", body)
        assert status == 200
        assert explained["decision"]["prefix_replicas"] == 1
        assert explained["decision"]["spill_cause"] is None
        assert explained["prompt_tokens"] > MAX_UNCACHED_TOKENS  # the first one was over it


async def _true(value: bool) -> bool:
    return value
