"""The simulated vLLM replica (loadtest.replica) over real sockets: vLLM's prefix-cache rules,
the OpenAI surface, metrics, timing and fault injection."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.replica import SimConfig, SimReplica, main, run_replicas
from loadtest.sim.engine import FINISHED, Engine, Seq
from loadtest.sim.kvcache import NONE_HASH, block_hashes, hash_block
from router.prompt import Renderer

MODEL = "Qwen/Qwen3-0.6B"
ROOT = Path(__file__).resolve().parents[1]

Start = Callable[..., Awaitable[SimReplica]]


@pytest.fixture
async def sim(reference_renderer: Renderer) -> AsyncIterator[Start]:
    """``await sim(**config)`` starts one replica sharing the session's tokenizer."""
    started: list[SimReplica] = []

    async def start(**overrides: Any) -> SimReplica:
        replica = SimReplica(SimConfig(**overrides), renderer=reference_renderer)
        await replica.start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(
    http: aiohttp.ClientSession, rep: SimReplica, path: str, body: Any
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(
        rep.url + path, data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


def cached(usage: dict[str, Any]) -> int:
    # vLLM sends prompt_tokens_details only when something was cached
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def complete(
    http: aiohttp.ClientSession, rep: SimReplica, prompt: Any, **extra: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    status, data = await post(http, rep, "/v1/completions", body)
    assert status == 200, data
    return data


async def cached_of(http: aiohttp.ClientSession, rep: SimReplica, prompt: Any, **extra: Any) -> int:
    return cached((await complete(http, rep, prompt, **extra))["usage"])


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(data: Any, param: str | None = None) -> None:
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


async def metrics(http: aiohttp.ClientSession, rep: SimReplica) -> dict[str, Any]:
    async with http.get(rep.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict[str, Any], name: str, **labels: str) -> float:
    rows = [v for lab, v in m[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(rows) == 1, (name, labels, m.get(name))
    return rows[0]


# ------------------------------------------------------------------ the hashing scheme


def test_block_hash_scheme_is_vllms() -> None:
    import hashlib
    import pickle

    assert hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest() == NONE_HASH
    toks = ids(100, 40)
    h = block_hashes(toks, 16)
    assert len(h) == 2  # only full blocks
    b0 = hashlib.sha256(pickle.dumps((NONE_HASH, tuple(toks[:16]), None), protocol=5)).digest()
    assert h[0] == b0 and h[1] == hash_block(b0, toks[16:32], None)
    salted = block_hashes(toks, 16, cache_salt="s")
    assert salted[0] == hash_block(NONE_HASH, toks[:16], (("cache_salt", "s"),))
    assert salted[1] == hash_block(salted[0], toks[16:32], None)  # salt on block 0 only
    lora = block_hashes(toks, 16, lora="a", cache_salt="s")
    assert lora[0] == hash_block(NONE_HASH, toks[:16], (("lora", "a"), ("cache_salt", "s")))
    assert lora[1] == hash_block(lora[0], toks[16:32], (("lora", "a"),))  # lora on every block


async def test_engine_hits_match_a_reference_model() -> None:
    """Random prompts built from earlier ones: with a pool too big to evict, every hit is the
    longest full-block prefix shared with anything cached before (prompt + all but the last
    generated token), same salt and adapter, capped at len(prompt) - 1."""
    bs = 4
    eng = Engine(
        block_size=bs,
        num_gpu_blocks=100_000,
        prefill_tokens_per_s=1.0,
        decode_tokens_per_s=1.0,
        request_overhead_s=0.0,
        max_num_seqs=8,
        instant=True,
    )
    rng = random.Random(7)
    history: list[tuple[Any, list[int]]] = []
    for i in range(300):
        key = (rng.choice([None, "s"]), rng.choice([None, "a"]))
        if history and rng.random() < 0.8:
            _, prev = rng.choice(history)
            prompt = prev[: rng.randint(0, len(prev))] + [rng.randint(0, 50) for _ in range(3)]
        else:
            prompt = [rng.randint(0, 50) for _ in range(rng.randint(1, 30))]
        prompt = prompt[:60] or [1]
        out = [rng.randint(0, 50) for _ in range(rng.randint(1, 6))]
        salt, lora = key
        seq = Seq(
            f"r{i}",
            prompt,
            out,
            block_hashes(prompt, bs, lora=lora, cache_salt=salt),
            lora=lora,
            cache_salt=salt,
        )
        best = 0
        for k, toks in history:
            if k == key:
                n = 0
                while n < min(len(toks), len(prompt)) and toks[n] == prompt[n]:
                    n += 1
                best = max(best, n // bs)
        expected = min(best, (len(prompt) - 1) // bs) * bs
        eng.submit([seq])
        assert seq.state == FINISHED
        assert seq.num_cached_tokens == expected, (i, prompt, history[-3:])
        history.append((key, (prompt + out)[: len(prompt) + len(out) - 1]))
    assert eng.pool.num_used == 0


async def test_decode_cost_delays_the_prefills_queued_behind_a_request() -> None:
    """With decode_cost_tokens, a request's decode takes max_tokens x cost prefill tokens of
    the FIFO after its prefill (vLLM batches decode with prefill); an idle gap absorbs it."""

    def engine(cost: float) -> Engine:
        return Engine(
            block_size=16,
            num_gpu_blocks=1000,
            prefill_tokens_per_s=1000.0,
            decode_tokens_per_s=1000.0,
            request_overhead_s=0.0,
            max_num_seqs=8,
            instant=False,
            decode_cost_tokens=cost,
        )

    def seqs() -> list[Seq]:  # two cold prompts of 100 tokens, 50 output tokens each
        out = []
        for i in (1, 2):
            prompt = [i] * 100
            out.append(Seq(f"r{i}", prompt, [7] * 50, block_hashes(prompt, 16)))
        return out

    for cost, gap in ((0.0, 0.0), (4.0, 0.2)):  # 50 x 4 = 200 tokens: 0.2 s at 1000 tok/s
        eng = engine(cost)
        a, b = seqs()
        eng.submit([a, b])
        assert a.prefill_end - a.prefill_start == pytest.approx(0.1)
        assert b.prefill_start - a.prefill_end == pytest.approx(gap), cost
        assert a.first_token_at == a.prefill_end  # its own first token is not delayed
        eng.abort_all()
    with pytest.raises(ValueError, match="decode_cost_tokens"):
        SimConfig(decode_cost_tokens=-1)


# ------------------------------------------------------------------ prefix-cache rules


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 100])
async def test_same_prompt_twice_hits_all_but_last_token(
    sim: Start, http: aiohttp.ClientSession, n: int
) -> None:
    rep = await sim()
    prompt = ids(1000, n)
    assert await cached_of(http, rep, prompt) == 0
    assert await cached_of(http, rep, prompt) == (n - 1) // 16 * 16


async def test_prompt_differing_at_token_k_hits_k_over_bs_blocks(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim()
    base = ids(1000, 100)
    await complete(http, rep, base)
    for j, k in enumerate([0, 5, 15, 16, 17, 40, 63, 64, 99]):
        variant = base[:k] + ids(5000 + 200 * j, 100 - k)
        assert await cached_of(http, rep, variant) == min(k // 16, 99 // 16) * 16, k


async def test_cache_salt_rekeys_everything(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim()
    p = ids(2000, 70)
    full = 69 // 16 * 16
    assert await cached_of(http, rep, p) == 0
    assert await cached_of(http, rep, p) == full
    assert await cached_of(http, rep, p, cache_salt="tenant-a") == 0
    assert await cached_of(http, rep, p, cache_salt="tenant-a") == full
    assert await cached_of(http, rep, p, cache_salt="tenant-b") == 0
    assert await cached_of(http, rep, p, cache_salt=None) == full  # null = no salt
    # chat requests obey the same salt
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}]}
    body["max_tokens"] = 1
    s1, d1 = await post(http, rep, "/v1/chat/completions", {**body, "cache_salt": "x"})
    s2, d2 = await post(http, rep, "/v1/chat/completions", body)
    s3, d3 = await post(http, rep, "/v1/chat/completions", {**body, "cache_salt": "x"})
    assert (s1, s2, s3) == (200, 200, 200)
    assert cached(d1["usage"]) == 0 and cached(d2["usage"]) == 0
    assert cached(d3["usage"]) == (d3["usage"]["prompt_tokens"] - 1) // 16 * 16


@pytest.mark.parametrize("salt", ["", "a" * 129, "a/b", "a@b", "a\\b", "a\x00b", 123, ["x"], True])
async def test_invalid_cache_salt_is_400(
    sim: Start, http: aiohttp.ClientSession, salt: Any
) -> None:
    rep = await sim(instant=True)
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ]:
        status, data = await post(http, rep, path, {**body, "cache_salt": salt})
        assert status == 400, (path, salt, data)
        assert_error(data, "cache_salt")
    assert rep.stats["requests"] == 0


async def test_valid_cache_salt_edge_cases(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim(instant=True)
    for salt in ["a" * 128, "x", "tenant:42 ünïcode-_.~+="]:
        await complete(http, rep, [1, 2, 3], cache_salt=salt)


async def test_lora_adapters_never_share_with_base_or_each_other(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim(lora_adapters=["sql", "chat"])
    p = ids(3000, 50)
    full = 49 // 16 * 16
    assert await cached_of(http, rep, p) == 0
    assert await cached_of(http, rep, p, model="sql") == 0
    assert await cached_of(http, rep, p, model="sql") == full
    assert await cached_of(http, rep, p, model="chat") == 0
    assert await cached_of(http, rep, p, model="chat", cache_salt="t") == 0
    assert await cached_of(http, rep, p) == full
    data = await complete(http, rep, p, model="sql")
    assert data["model"] == "sql"
    assert {r["lora"] for r in rep.stats["records"]} == {None, "sql", "chat"}


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # free queue after A, B: [A3 A2 A1 A0 B3 B2 B1 B0] (each request's tail first);
        # C takes two blocks from the head: A's partial block and A's third block.
        (["A", "B", "C"], {"A": 8, "B": 12}),
        # A's second run touches its blocks, so they move behind B's: C evicts from B.
        (["A", "B", "A", "C"], {"A": 12, "B": 8}),
    ],
)
async def test_lru_eviction_with_a_tiny_pool(
    sim: Start, http: aiohttp.ClientSession, order: list[str], expected: dict[str, int]
) -> None:
    rep = await sim(block_size=4, num_gpu_blocks=8)
    prompts = {"A": ids(1000, 13), "B": ids(2000, 13), "C": ids(3000, 5)}
    for name in order:
        await complete(http, rep, prompts[name])
    pool = rep.engine.pool
    assert pool.num_used == 0

    def held(p: list[int]) -> int:
        return len(pool.lookup(block_hashes(p, 4), (len(p) - 1) // 4)) * 4

    assert {name: held(prompts[name]) for name in expected} == expected
    # over HTTP too, for one of them (a request allocates blocks, so it changes the pool)
    first = next(iter(expected))
    assert await cached_of(http, rep, prompts[first]) == expected[first]


async def test_generated_tokens_hit_on_the_next_turn(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim()
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about caches."},
    ]
    m = 20
    s1, d1 = await post(
        http, rep, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": m}
    )
    assert s1 == 200
    p1 = d1["usage"]["prompt_tokens"]
    assert d1["usage"]["completion_tokens"] == m
    answer = d1["choices"][0]["message"]["content"]
    assert answer and d1["choices"][0]["finish_reason"] == "length"
    turn2 = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    s2, d2 = await post(
        http, rep, "/v1/chat/completions", {"model": MODEL, "messages": turn2, "max_tokens": 4}
    )
    assert s2 == 200
    p2 = d2["usage"]["prompt_tokens"]
    assert p2 > p1 + m
    # all of turn 1's computed tokens (prompt + every answer token but the last) are cached
    assert cached(d2["usage"]) == (p1 + m - 1) // 16 * 16
    assert cached(d2["usage"]) > (p1 - 1) // 16 * 16


async def test_outputs_are_deterministic_per_prompt_and_seed(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    a, b = await sim(instant=True), await sim(instant=True, seed=1)
    p = ids(4000, 10)
    t1 = (await complete(http, a, p, max_tokens=8))["choices"][0]["text"]
    t2 = (await complete(http, a, p, max_tokens=8))["choices"][0]["text"]
    t3 = (await complete(http, b, p, max_tokens=8))["choices"][0]["text"]
    t4 = (await complete(http, a, ids(4001, 10), max_tokens=8))["choices"][0]["text"]
    assert t1 == t2 and t1 != t3 and t1 != t4
    status, data = await post(http, a, "/tokenize", {"model": MODEL, "prompt": t1})
    assert data["count"] == 8  # eight word tokens that re-tokenize as themselves


# ------------------------------------------------------------------ OpenAI surface


async def test_chat_streaming_shape_and_usage_chunk(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream please"}]}
    body["max_tokens"] = 5
    status, full = await post(http, rep, "/v1/chat/completions", body)
    assert status == 200 and full["object"] == "chat.completion"
    assert set(full["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(rep.url + "/v1/chat/completions", json=stream_body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:]
    assert len(tokens) == 5  # one chunk per output token
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert text == full["choices"][0]["message"]["content"]
    assert usage_chunk["choices"] == []
    u = usage_chunk["usage"]
    assert u["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
    assert cached(u) == (u["prompt_tokens"] - 1) // 16 * 16

    async with http.post(rep.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        events = await sse_events(resp)
    assert all("usage" not in e for e in events[:-1])  # no usage chunk unless asked
    assert len(events) == 1 + 5 + 1


async def test_prompt_tokens_details_as_vllm_sends_them(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.34 attaches prompt_tokens_details whenever enabled ({cached_tokens: 0} on a
    miss); ``always_report_cached_tokens=False`` gives older releases' null on a miss."""
    rep = await sim(instant=True)
    p = ids(800, 40)
    miss = (await complete(http, rep, p))["usage"]
    assert miss["prompt_tokens_details"] == {"cached_tokens": 0}
    hit = (await complete(http, rep, p))["usage"]
    assert hit["prompt_tokens_details"] == {"cached_tokens": 32}
    body = {"model": MODEL, "prompt": ids(900, 40), "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with http.post(rep.url + "/v1/completions", json=body) as resp:
        usage = (await sse_events(resp))[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

    off = await sim(instant=True, enable_prompt_tokens_details=False)
    await complete(http, off, p)
    assert (await complete(http, off, p))["usage"]["prompt_tokens_details"] is None
    old = await sim(instant=True, always_report_cached_tokens=False)
    assert (await complete(http, old, p))["usage"]["prompt_tokens_details"] is None
    assert (await complete(http, old, p))["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    async with http.post(old.url + "/v1/completions", json=body) as resp:
        usage = (await sse_events(resp))[-2]["usage"]
    assert "prompt_tokens_details" not in usage  # unset in a stream's usage chunk


async def test_completions_batch_and_streaming(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim()
    data = await complete(http, rep, ["first prompt", "second prompt here"], max_tokens=3)
    assert [c["index"] for c in data["choices"]] == [0, 1]
    status, tok1 = await post(http, rep, "/tokenize", {"model": MODEL, "prompt": "first prompt"})
    status, tok2 = await post(
        http, rep, "/tokenize", {"model": MODEL, "prompt": "second prompt here"}
    )
    assert data["usage"]["prompt_tokens"] == tok1["count"] + tok2["count"]
    assert data["usage"]["completion_tokens"] == 6

    body = {
        "model": MODEL,
        "prompt": [ids(100, 20), ids(300, 20)],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(rep.url + "/v1/completions", json=body) as resp:
        events = await sse_events(resp)
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    per_index: dict[int, list[Any]] = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        per_index[choice["index"]].append(choice)
    for choices in per_index.values():
        assert len(choices) == 4
        assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    assert events[-2]["usage"]["prompt_tokens"] == 40
    assert events[-2]["usage"]["completion_tokens"] == 8


async def test_tokenize_chat_form_is_what_the_request_is_charged(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim()
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a KV cache? " * 5},
        ],
    }
    status, tok = await post(http, rep, "/tokenize", chat)
    assert status == 200 and set(tok) >= {"count", "max_model_len", "tokens"}
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 40960
    status, data = await post(http, rep, "/v1/chat/completions", {**chat, "max_tokens": 1})
    n = data["usage"]["prompt_tokens"]
    assert n == tok["count"]
    # the chat request cached exactly these ids' blocks
    assert await cached_of(http, rep, tok["tokens"]) == (n - 1) // 16 * 16
    status, detok = await post(http, rep, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"].startswith("<|im_start|>system\nBe brief.")
    assert detok["prompt"].endswith("<|im_start|>assistant\n")
    status, again = await post(http, rep, "/tokenize", {"model": MODEL, "prompt": detok["prompt"]})
    assert again["tokens"] == tok["tokens"]


async def test_models_health_version_and_unknown_model(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim(lora_adapters=["sql"], instant=True)
    async with http.get(rep.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    cards = {c["id"]: c for c in models["data"]}
    assert set(cards) == {MODEL, "sql"}
    assert cards[MODEL]["parent"] is None and cards[MODEL]["max_model_len"] == 40960
    assert cards["sql"]["parent"] == MODEL and cards["sql"]["object"] == "model"
    async with http.get(rep.url + "/health") as resp:
        assert resp.status == 200
    rep.health_status = 503
    async with http.get(rep.url + "/health") as resp:
        assert resp.status == 503
    async with http.get(rep.url + "/version") as resp:
        assert "version" in await resp.json()
    for path, body in [
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"model": "nope", "prompt": "x"}),
    ]:
        status, data = await post(http, rep, path, body)
        assert status == 404
        assert_error(data)
        assert data["error"]["message"] == "The model `nope` does not exist."
    async with http.get(rep.url + "/no/such/route") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [-1]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": 7, "prompt": "x"}, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "maybe"}, "stream"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, None),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            None,
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            None,
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50_000},
            None,
        ),
        ("/tokenize", {"model": MODEL}, None),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
    ],
)
async def test_bad_input_is_a_4xx_and_the_replica_lives_on(
    sim: Start, http: aiohttp.ClientSession, path: str, body: Any, param: str | None
) -> None:
    rep = await sim(instant=True)
    status, data = await post(http, rep, path, body)
    assert status == 400, data
    assert_error(data, param)
    assert rep.stats["requests"] == 0
    await complete(http, rep, "still alive")


async def test_requests_that_cannot_fit_are_rejected_not_hung(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim(instant=True, block_size=4, num_gpu_blocks=4, max_model_len=64)
    # 13 prompt + 8 output -> 20 computed tokens -> 5 blocks > 4
    status, data = await post(
        http, rep, "/v1/completions", {"model": MODEL, "prompt": ids(10, 13), "max_tokens": 8}
    )
    assert status == 400
    assert_error(data)
    status, data = await post(
        http, rep, "/v1/completions", {"model": MODEL, "prompt": ids(10, 60), "max_tokens": 8}
    )
    assert status == 400 and "maximum context length is 64" in data["error"]["message"]
    await complete(http, rep, ids(10, 13), max_tokens=4)  # 16 tokens: exactly 4 blocks


# ------------------------------------------------------------------ metrics and timing


async def test_metrics_parse_and_move(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim()
    m0 = await metrics(http, rep)
    lab = {"model_name": MODEL, "engine": "0"}
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ]:
        assert value(m0, name, **lab) == 0, name
    ((info_labels, info_value),) = m0["vllm:cache_config_info"]
    assert info_value == 1
    assert info_labels["block_size"] == "16" and info_labels["num_gpu_blocks"] == "4096"

    p = ids(500, 41)
    await complete(http, rep, p, max_tokens=3)
    await complete(http, rep, p, max_tokens=3)
    m1 = await metrics(http, rep)
    assert value(m1, "vllm:prefix_cache_queries_total", **lab) == 82
    assert value(m1, "vllm:prefix_cache_hits_total", **lab) == 32
    assert value(m1, "vllm:prompt_tokens_total", **lab) == 82
    assert value(m1, "vllm:generation_tokens_total", **lab) == 6
    assert value(m1, "vllm:request_success_total", finished_reason="length", **lab) == 2
    assert value(m1, "vllm:time_to_first_token_seconds_count", **lab) == 2
    assert value(m1, "vllm:e2e_request_latency_seconds_count", **lab) == 2
    assert value(m1, "vllm:time_to_first_token_seconds_sum", **lab) > 0
    assert value(m1, "vllm:num_requests_running", **lab) == 0
    assert value(m1, "vllm:kv_cache_usage_perc", **lab) == 0
    assert rep.stats["queries"] == 82 and rep.stats["hits"] == 32


async def test_ttft_rises_for_a_cold_long_prompt_and_follows_the_prefill_fifo(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim(prefill_tokens_per_s=40_000, decode_tokens_per_s=5_000)
    loop = asyncio.get_running_loop()

    async def ttft(prompt: list[int]) -> float:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        t0 = loop.time()
        async with http.post(rep.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            first = loop.time() - t0
            await resp.read()
        return first

    long = ids(1000, 4000)  # 0.1 s of prefill when cold
    cold = await ttft(long)
    warm = await ttft(long)
    assert cold > warm + 0.05, (cold, warm)
    ttfts = [r["ttft_s"] for r in rep.stats["records"]]
    assert ttfts[0] > 20 * ttfts[1]

    # two cold prompts at once share one prefill FIFO: the second waits for the first
    await asyncio.gather(ttft(ids(20_000, 4000)), ttft(ids(30_000, 4000)))
    a, b = sorted(r["ttft_s"] for r in list(rep.stats["records"])[-2:])
    assert b > 1.5 * a
    queued = max(r["queue_s"] for r in list(rep.stats["records"])[-2:])
    assert queued > 0.05


async def test_waiting_when_the_pool_is_full_and_disconnect_frees_blocks(
    sim: Start, http: aiohttp.ClientSession
) -> None:
    rep = await sim(block_size=4, num_gpu_blocks=8, decode_tokens_per_s=50)
    big = {"model": MODEL, "prompt": ids(1000, 13), "max_tokens": 16, "stream": True}
    resp = await http.post(rep.url + "/v1/completions", json=big)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # running: 13 + 15 tokens reserve 7 of 8 blocks
    assert rep.counts() == (1, 0)
    assert 0 < rep.kv_cache_usage < 1

    small = asyncio.ensure_future(complete(http, rep, ids(2000, 5), max_tokens=4))  # 2 blocks
    await rep.wait_for(lambda r: r.counts()[1] == 1)
    m = await metrics(http, rep)
    lab = {"model_name": MODEL, "engine": "0"}
    assert value(m, "vllm:num_requests_waiting", **lab) == 1
    assert value(m, "vllm:num_requests_running", **lab) == 1
    assert not small.done()

    resp.close()  # the client goes away mid-stream: the request stops, its blocks free up
    data = await asyncio.wait_for(small, 10)
    assert data["usage"]["completion_tokens"] == 4
    await rep.wait_idle()
    assert rep.stats["aborted"] == 1
    assert rep.engine.pool.num_used == 0 and rep.engine.reserved == 0
    aborted = [r for r in rep.stats["records"] if r["finish_reason"] == "abort"]
    assert len(aborted) == 1 and aborted[0]["completion_tokens"] < 16


async def test_many_concurrent_streams(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim(max_num_seqs=16, decode_tokens_per_s=1_000)

    async def one(i: int) -> int:
        body = {"model": MODEL, "prompt": ids(100 + i, 30), "max_tokens": 20, "stream": True}
        async with http.post(rep.url + "/v1/completions", json=body) as resp:
            return len(await sse_events(resp)) - 1

    assert await asyncio.gather(*(one(i) for i in range(60))) == [20] * 60
    assert rep.stats["finished"] == 60 and rep.engine.idle()


# ------------------------------------------------------------------ fault injection, lifecycle


async def test_fail_next(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim(instant=True)
    rep.fail_next(2, status=503)
    status, data = await post(http, rep, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503
    assert_error(data)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with http.post(rep.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 503  # before any byte of the stream
        assert_error(await resp.json())
    async with http.get(rep.url + "/health") as resp:  # only generation requests fail
        assert resp.status == 200
    await complete(http, rep, "x")
    rep.fail_next(1, status=429)
    status, _ = await post(http, rep, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 429
    assert rep.stats["injected_failures"] == 3 and rep.stats["requests"] == 1


async def test_reset_cache(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim()
    p = ids(700, 40)
    await complete(http, rep, p)
    assert await cached_of(http, rep, p) == 32
    rep.reset_cache()
    assert await cached_of(http, rep, p) == 0


async def test_stop_aborts_open_connections(sim: Start, http: aiohttp.ClientSession) -> None:
    rep = await sim(decode_tokens_per_s=20)
    body = {"model": MODEL, "prompt": ids(10, 20), "max_tokens": 100, "stream": True}
    resp = await http.post(rep.url + "/v1/completions", json=body)
    await resp.content.readuntil(b"\n\n")
    url = rep.url
    await rep.stop()
    with pytest.raises(aiohttp.ClientError):
        await resp.read()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(url + "/health") as r:
            await r.read()
    assert rep.engine.idle() and rep.engine.pool.num_used == 0
    # a restarted replica comes back empty, like a new process
    await rep.start(port=int(url.rsplit(":", 1)[1]))
    assert rep.url == url
    assert await cached_of(http, rep, ids(10, 20)) == 0


async def test_run_replicas_shares_one_tokenizer(reference_renderer: Renderer) -> None:
    async with run_replicas(2, instant=True, block_size=8, renderer=reference_renderer) as reps:
        assert reps[0].renderer is reps[1].renderer is reference_renderer
        assert reps[0].url != reps[1].url
        assert all(r.config.block_size == 8 for r in reps)


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ["--port", "--count", "--block-size", "--num-gpu-blocks", "--lora", "--instant"]:
        assert flag in out


def test_cli_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtest.replica",
            "--port",
            "0",
            "--count",
            "2",
            "--instant",
            "--lora",
            "sql",
            "--block-size",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        urls = []
        deadline = time.monotonic() + 60
        while len(urls) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("ready "):
                urls.append(line.split()[1])
        assert len(urls) == 2, proc.stderr.read() if proc.stderr else ""

        async def probe() -> None:
            async with aiohttp.ClientSession() as s:
                for url in urls:
                    async with s.get(url + "/v1/models") as r:
                        ids_ = [c["id"] for c in (await r.json())["data"]]
                        assert ids_ == [MODEL, "sql"]
                    async with s.get(url + "/metrics") as r:
                        assert 'block_size="8"' in await r.text()

        asyncio.run(probe())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
