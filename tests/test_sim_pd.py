"""The simulated replica's prefill/decode disaggregation (loadtest.sim.nixl) over real sockets:
vLLM 0.34's NixlConnector in pull mode, as a proxy drives it (vLLM's
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): the prefill leg's answer, the
decode leg's pull of only the blocks it lacks, leases, and the failures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from loadtest.replica import SimReplica
from loadtest.sim.kvcache import block_hashes

MODEL = "Qwen/Qwen3-0.6B"
BS = 16
Start = Callable[..., Awaitable[SimReplica]]


@pytest.fixture
def sim(fleet: Callable[..., Awaitable[list[SimReplica]]]) -> Start:
    """``await sim(**config)``: one replica with the NIXL connector (conftest's ``fleet``
    starts and stops it)."""

    async def start(**overrides: Any) -> SimReplica:
        overrides.setdefault("kv_connector", "NixlConnector")
        (replica,) = await fleet(1, **overrides)
        return replica

    return start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(http: aiohttp.ClientSession, rep: SimReplica, body: Any) -> tuple[int, Any]:
    async with http.post(rep.url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


PROMPT = "Summarise the following report in three sentences. " * 20


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's P leg (toy_proxy_server.py): one token, no stream, do_remote_decode."""
    return {
        **body,
        "max_tokens": 1,
        "stream": False,
        "return_token_ids": True,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }


def decode_leg(body: dict[str, Any], p_answer: dict[str, Any]) -> dict[str, Any]:
    """The D leg: the client's body with P's params verbatim plus P's prompt ids."""
    params = {**p_answer["kv_transfer_params"], "prompt_token_ids": p_answer["prompt_token_ids"]}
    return {**body, "kv_transfer_params": params}


async def test_prefill_leg_pins_its_blocks_and_names_them(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    p = await sim()
    status, answer = await post(http, p, prefill_leg(chat(PROMPT)))
    assert status == 200
    ids = answer["prompt_token_ids"]
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull"
    assert params["remote_engine_id"] == p.nixl.engine_id  # type: ignore[union-attr]
    assert params["remote_host"] == "localhost"  # vLLM's default side-channel host
    assert params["remote_port"] == p.port
    assert params["remote_num_tokens"] == len(ids)
    assert params["remote_prefill_cached_tokens"] == 0
    (block_ids,) = params["remote_block_ids"]
    assert len(block_ids) == -(-len(ids) // BS)
    # The blocks stay pinned after the request finished: in use, not in the free queue.
    held = p.engine.held[params["remote_request_id"]]
    assert [b.block_id for b in held.blocks] == block_ids
    assert all(b.ref_cnt == 1 for b in held.blocks)
    assert p.engine.pool.num_used == len(block_ids)


async def test_decode_leg_pulls_only_the_blocks_it_lacks(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    p, d = await sim(), await sim()
    body = chat(PROMPT, max_tokens=8)
    _, first_p = await post(http, p, prefill_leg(body))
    n = len(first_p["prompt_token_ids"])
    status, first_d = await post(http, d, decode_leg(body, first_p))
    assert status == 200
    assert first_d["choices"][0]["finish_reason"] == "length"
    assert d.stats["pulled_blocks"] == -(-n // BS)  # nothing local: every block pulled
    assert d.stats["external_tokens"] == n
    assert d.stats["kv_corrupt_reads"] == d.stats["kv_load_failures"] == 0
    # Reading the blocks freed them on P (its prefix cache keeps them, evictable).
    assert not p.engine.held and p.engine.pool.num_used == 0
    assert all(p.engine.pool.is_cached(h) for h in block_hashes(first_p["prompt_token_ids"], BS))
    # D cached the pulled full blocks as its own.
    assert all(d.engine.pool.is_cached(h) for h in block_hashes(first_p["prompt_token_ids"], BS))

    # The next turn repeats the prompt and adds to it: P computes only the new part (its own
    # prefix cache), and D pulls only the blocks past what it holds.
    longer = chat(PROMPT + " And then list the risks it names, one a line.", max_tokens=8)
    _, second_p = await post(http, p, prefill_leg(longer))
    ids, later = first_p["prompt_token_ids"], second_p["prompt_token_ids"]
    m = len(later)
    shared = next(i for i, (a, b) in enumerate(zip(ids, later, strict=False)) if a != b) // BS
    assert shared >= 10  # the turns share most of their blocks
    assert second_p["kv_transfer_params"]["remote_prefill_cached_tokens"] == shared * BS
    _, second_d = await post(http, d, decode_leg(longer, second_p))
    pulled = d.stats["pulled_blocks"] - -(-n // BS)
    assert pulled == -(-m // BS) - shared
    # vLLM 0.34: D's usage reports P's cached count, not its own.
    details = second_d["usage"]["prompt_tokens_details"]
    assert (
        details["cached_tokens"] == second_p["kv_transfer_params"]["remote_prefill_cached_tokens"]
    )
    records = list(d.stats["records"])
    assert records[-1]["cached_tokens"] == shared * BS  # D's own hit, as its metrics count


async def test_metrics_count_pulled_tokens_apart_from_local_hits(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    p, d = await sim(), await sim()
    body = chat(PROMPT)
    _, p_answer = await post(http, p, prefill_leg(body))
    await post(http, d, decode_leg(body, p_answer))
    async with http.get(d.url + "/metrics") as resp:
        page = await resp.text()
    n = len(p_answer["prompt_token_ids"])
    assert (
        f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} {n:.1f}' in page
    )
    assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 0.0' in page


async def test_first_pull_from_a_prefill_engine_pays_the_handshake(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rate = 100_000.0
    p = await sim(prefill_tokens_per_s=rate)
    d = await sim(prefill_tokens_per_s=rate, kv_handshake_s=0.2, kv_block_transfer_s=0.001)
    overhead = d.config.request_overhead_s
    ttfts = []
    for text in (PROMPT, "Another report entirely. " * 30):
        body = chat(text, max_tokens=2)
        _, p_answer = await post(http, p, prefill_leg(body))
        await post(http, d, decode_leg(body, p_answer))
        record = list(d.stats["records"])[-1]
        blocks = record["pulled_blocks"]
        assert blocks == -(-len(p_answer["prompt_token_ids"]) // BS)
        ttfts.append((record["ttft_s"], blocks))
    # Virtual time: the pull, then the last prompt token computed on D, then the overhead.
    (first, b1), (second, b2) = ttfts
    assert first == pytest.approx(0.2 + b1 * 0.001 + 1 / rate + overhead)
    assert second == pytest.approx(b2 * 0.001 + 1 / rate + overhead)


async def test_the_same_params_sent_to_a_second_decode_replica_read_freed_blocks(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    """What a gateway must never do: real NIXL reads the freed (maybe reused) blocks silently;
    the simulator answers the same and counts the corrupt read."""
    p, d1, d2 = await sim(), await sim(), await sim()
    body = chat(PROMPT)
    _, p_answer = await post(http, p, prefill_leg(body))
    assert (await post(http, d1, decode_leg(body, p_answer)))[0] == 200
    status, _ = await post(http, d2, decode_leg(body, p_answer))
    assert status == 200
    assert d1.stats["kv_corrupt_reads"] == 0
    assert d2.stats["kv_corrupt_reads"] == 1


async def test_an_expired_lease_frees_the_blocks(sim: Start, http: aiohttp.ClientSession) -> None:
    p, d = await sim(kv_lease_s=0.05), await sim()
    body = chat(PROMPT)
    _, p_answer = await post(http, p, prefill_leg(body))
    assert p.engine.held
    await p.wait_for(lambda r: not r.engine.held, timeout=5)
    assert p.stats["kv_leases_expired"] == 1 and p.engine.pool.num_used == 0
    await post(http, d, decode_leg(body, p_answer))
    assert d.stats["kv_corrupt_reads"] == 1


async def test_an_unreachable_prefill_replica_fails_the_decode_leg(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    p, d = await sim(), await sim()
    recompute = await sim(kv_load_failure_policy="recompute")
    body = chat(PROMPT, max_tokens=4)
    _, p_answer = await post(http, p, prefill_leg(body))
    await p.stop()  # the prefill replica died with the blocks
    status, answer = await post(http, d, decode_leg(body, p_answer))
    assert status == 500 and answer["error"]["type"] == "InternalServerError"
    assert d.stats["kv_load_failures"] == 1
    # Streamed: vLLM has sent its headers and the role chunk; the error follows as an event.
    async with http.post(
        d.url + "/v1/chat/completions", json={**decode_leg(body, p_answer), "stream": True}
    ) as resp:
        assert resp.status == 200
        events = [
            line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")
        ]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[1])["error"]["type"] == "InternalServerError"
    assert events[2:] == ["[DONE]"]
    # kv_load_failure_policy "recompute": D computes the prompt itself.
    status, answer = await post(http, recompute, decode_leg(body, p_answer))
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    record = list(recompute.stats["records"])[-1]
    assert record["pulled_blocks"] == 0 and record["finish_reason"] == "length"


async def test_a_refused_decode_leg_frees_the_prefill_blocks(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    p, d = await sim(), await sim()
    body = chat(PROMPT)
    _, p_answer = await post(http, p, prefill_leg(body))
    assert p.engine.held
    status, _ = await post(http, d, {**decode_leg(body, p_answer), "max_tokens": 10**6})
    assert status == 400
    assert not p.engine.held  # D's serving layer told P to free them


async def test_without_a_connector_transfer_params_are_ignored(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    plain = await sim(kv_connector=None)
    status, answer = await post(http, plain, prefill_leg(chat(PROMPT)))
    assert status == 200
    assert answer["kv_transfer_params"] is None  # a fleet misconfigured for P/D
    assert not plain.engine.held and plain.engine.pool.num_used == 0
    status, answer = await post(http, plain, {**chat("hi"), "kv_transfer_params": "yes"})
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"


async def test_completions_legs(sim: Start, http: aiohttp.ClientSession) -> None:
    p, d = await sim(), await sim()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    leg = prefill_leg(body)
    async with http.post(p.url + "/v1/completions", json=leg) as resp:
        p_answer = await resp.json()
    params = p_answer["kv_transfer_params"]
    ids = p_answer["choices"][0]["prompt_token_ids"]
    assert params["remote_num_tokens"] == len(ids)
    d_body = {**body, "kv_transfer_params": {**params, "prompt_token_ids": ids}}
    async with http.post(d.url + "/v1/completions", json=d_body) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert d.stats["pulled_blocks"] == -(-len(ids) // BS)


async def test_messages_and_responses_legs(sim: Start, http: aiohttp.ClientSession) -> None:
    """vLLM 0.34 takes kv_transfer_params on /v1/messages and /v1/responses too
    (entrypoints/anthropic/protocol.py, responses/protocol.py) and answers them top level."""
    p, d = await sim(), await sim()
    for path, body in (
        ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}),
        ("/v1/responses", {"input": "Another text entirely. " * 30, "max_output_tokens": 1}),
    ):
        leg = {**prefill_leg({"model": MODEL, **body}), "store": False}
        leg.pop("return_token_ids")
        async with http.post(p.url + path, json=leg) as resp:
            assert resp.status == 200
            params = (await resp.json())["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        before = d.stats["pulled_blocks"]
        d_body = {"model": MODEL, **body, "kv_transfer_params": params}
        async with http.post(d.url + path, json=d_body) as resp:
            assert resp.status == 200
        assert d.stats["pulled_blocks"] - before == len(params["remote_block_ids"][0])
    assert d.stats["kv_corrupt_reads"] == d.stats["kv_load_failures"] == 0
