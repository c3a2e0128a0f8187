"""The lazy tail (router/prompt/lazy.py, router/routing/lazy_tail.py) decides exactly as full
tokenization does, and records the same hashes in the end.

A real gateway in front of simulated replicas (loopback HTTP for their health and models), the
bundled Qwen3 tokenizer; hypothesis draws multi-turn conversations (new user turns, earlier
answers the gateway never tokenized), salts, what the gateway's segment cache has seen, and
what each replica's index entry holds: prompts this gateway recorded, and any prefix of the
prompt itself as another gateway (fleet mode) or the replica's own cached answer tokens would
put there. ``PREFIX_ROUTER_LAZY_EXAMPLES`` (default 60) runs deeper.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.replica import SimConfig, SimReplica
from router.config import load_config
from router.core.blocks import block_hashes
from router.gateway import Gateway
from router.index import MemoryIndex
from router.intake.routed_request import RoutedRequest
from router.prompt import Renderer
from router.prompt.lazy import cut_rule, cuts
from router.routing.lazy_tail import policy_allows, tail_of
from router.schedule import from_config
from router.schedule.ring import HashRing
from tests.conftest import TOKENIZER_DIR

EXAMPLES = int(os.environ.get("PREFIX_ROUTER_LAZY_EXAMPLES", "60"))
MODEL = "Qwen/Qwen3-0.6B"
BLOCK = 16

# Words and separators that exercise the cut rule's edges: contractions, accents (composed
# and combining), digits, punctuation, CJK, emoji, runs of spaces and newlines.
WORDS = [
    "alpha", "refund", "policy", "it's", "we'll", "DON'T", "they're", "café", "nai\u0308ve",
    "e\u0301", "Straße", "123", "4.5", "x2", "日本語", "über", "naïve", "🙂", "a", "I",
    "'s", "ok", "end", "Ω", "z",
]  # fmt: skip
SEPS = [" ", " ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "\t", " - ", "' "]

words = st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPS)), max_size=700)
text = words.map(lambda ws: "".join(w + s for w, s in ws))
long_text = st.lists(st.sampled_from(WORDS), min_size=60, max_size=700).map(" ".join)
SYSTEMS = [
    "You are a careful support assistant. " * 60,
    "Answer briefly; cite the policy section. It's important.\n" * 40,
]


def body(system: str, turns: list[tuple[str, str]], user: str, salt: str | None) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for u, a in turns:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": user})
    out: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4}
    if salt is not None:
        out["cache_salt"] = salt
    return json.dumps(out).encode()


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    turns = draw(st.lists(st.tuples(st.one_of(text, long_text), text), max_size=3))
    n = len(turns)
    replicas = []
    for _ in range(3):
        replicas.append(
            {
                # earlier prompts of this conversation (this gateway recorded them)
                "earlier": draw(st.lists(st.integers(0, n), max_size=2)),
                # a prefix of this very prompt: another gateway, or cached answer tokens
                "own_prefix": draw(
                    st.one_of(st.none(), st.none(), st.integers(0, 24), st.integers(0, 400))
                ),
                "inflight": draw(st.integers(0, 3)),
                "pending": draw(st.integers(0, 3000)),
            }
        )
    return {
        "system": draw(st.one_of(st.sampled_from(SYSTEMS), text)),
        "turns": turns,
        "user": draw(st.one_of(long_text, text)),
        "salt": draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
        # turns whose prompts this gateway tokenized before (its segment cache), and whether
        # they were sent under another salt (then they do not count)
        "seen": draw(st.lists(st.integers(0, n), min_size=draw(st.sampled_from([0, 1, 1])))),
        "seen_salt": draw(st.sampled_from([None, "tenant-a", "other"])),
        "capacity": draw(st.sampled_from([100_000, 100_000, 40])),
        "replicas": replicas,
    }


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.renderer = Renderer.from_pretrained(TOKENIZER_DIR)
        self.reference = Renderer(self.renderer.tokenizer, segment_cache=False)
        self.sims = [SimReplica(SimConfig(instant=True), renderer=self.reference) for _ in "abc"]
        urls = [self.run(s.start()) for s in self.sims]
        config = load_config(None, env={}, replicas=urls, block_size=BLOCK)
        self.gw = Gateway(config, self.renderer)
        self.run(self.gw.start())
        assert self.gw.fleet is not None
        self.urls = sorted(self.gw.fleet.replicas)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def drain(self) -> None:
        """Wait for the gateway's background work (the tail's record)."""
        await asyncio.gather(*self.gw._background)

    def ids(self, raw: bytes) -> list[int]:
        return self.reference.tokenize_chat(json.loads(raw))

    def close(self) -> None:
        self.run(self.gw.stop())
        for s in self.sims:
            self.run(s.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_the_bundled_tokenizer_cuts_exactly(harness: Harness) -> None:
    backend = harness.renderer.tokenizer.backend_tokenizer
    assert cut_rule(backend) is None
    assert policy_allows(harness.gw.policy) is None and harness.gw.path.lazy_tail


@settings(max_examples=150, deadline=None)
@given(t=text)
def test_every_cut_splits_the_tokens_exactly(t: str) -> None:
    backend = _BACKEND()
    whole = backend.encode(t, add_special_tokens=False).ids
    for c in cuts(t)[:8]:
        left = backend.encode(t[:c], add_special_tokens=False).ids
        right = backend.encode(t[c:], add_special_tokens=False).ids
        assert left + right == whole, (t[:c], t[c:])


@functools.cache
def _BACKEND() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{TOKENIZER_DIR}/tokenizer.json")


def test_policies_that_read_more_than_integer_costs_stay_exact() -> None:
    """A fractional weight or the KV-usage scorer could turn the estimate into a different
    comparison in floating point: the gateway then tokenizes everything up front."""
    ring = HashRing()
    for overrides, allowed in [
        ({}, True),
        ({"policy": "sticky_prefix"}, True),
        ({"policy": "ring_spill"}, True),
        ({"policy": "ttft", "schedule": {"policy": "ttft", "params": {"kv_pressure": 500}}}, False),
        ({"policy": "ttft", "decode_cost_tokens": 7.5}, False),
        ({"policy": "ttft"}, True),
        ({"policy": "random"}, True),  # its picker registers as "random" (a list said random_pick)
        ({"policy": "least_loaded"}, True),
        ({"policy": "round_robin"}, True),
        ({"policy": "consistent_hash"}, True),
    ]:
        config = load_config(None, env={}, replicas=["http://x"], **overrides)
        assert (policy_allows(from_config(config.routing, ring)) is None) == allowed, overrides


@pytest.mark.parametrize("rest", ["inline", "thread"])
def test_lazy_decisions_and_records_equal_full_tokenization(
    harness: Harness, rest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of finishing a head: on the loop once the request is sent (a small rest),
    and in a worker thread."""
    gw, renderer = harness.gw, harness.renderer
    monkeypatch.setattr(gw.path, "_lazy_min_rest", lambda renderer: 0)  # every new turn may be lazy
    monkeypatch.setattr(gw.path, "_tail_inline", lambda head, renderer: rest == "inline")
    seen = {"head": 0, "full": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases())
    def check(case: dict[str, Any]) -> None:
        system, turns, salt = case["system"], case["turns"], case["salt"]
        raw = body(system, turns, case["user"], salt)
        ids = harness.ids(raw)
        renderer.clear_cache()
        gw.index = MemoryIndex(case["capacity"])
        for j in case["seen"]:  # the gateway tokenized turn j's prompt before
            seen_raw = body(system, turns[:j], turns[j][0] if j < len(turns) else "", None)
            with renderer.cache_scope(case["seen_salt"] if salt is None else salt):
                renderer.chat_ids(json.loads(seen_raw))
        assert gw.fleet is not None
        for url, spec in zip(harness.urls, case["replicas"], strict=True):
            for j in spec["earlier"]:
                u = turns[j][0] if j < len(turns) else case["user"]
                earlier = harness.ids(body(system, turns[:j], u, salt))
                harness.run(
                    gw.index.record(
                        url, block_hashes(earlier, BLOCK, cache_salt=salt, namespace=MODEL)
                    )
                )
            if spec["own_prefix"] is not None:
                own = block_hashes(ids, BLOCK, cache_salt=salt, namespace=MODEL)[
                    : spec["own_prefix"]
                ]
                harness.run(gw.index.record(url, own))
            replica = gw.fleet.replicas[url]
            replica.inflight, replica.pending_prefill_tokens = spec["inflight"], spec["pending"]

        lazy = harness.run(gw.path.prepare(raw, {}, "chat", "lazy", tenant="t", lazy=True))
        before = copy.deepcopy(gw.index)
        lazy_decision = harness.run(gw.path.decide(lazy))
        tail = tail_of(lazy)
        if tail is not None:
            seen["full" if tail.full is not None else "head"] += 1
            assert (tail.finish_inline is not None) == (rest == "inline")
            assert list(lazy.token_ids) == ids[: len(lazy.token_ids)]
        harness.run(gw.path.record_placement(lazy, lazy_decision))
        harness.run(harness.drain())
        recorded_lazily = gw.index

        gw.index = before
        full = harness.run(gw.path.prepare(raw, {}, "chat", "full", tenant="t"))
        assert tail_of(full) is None and list(full.token_ids) == ids
        decision = harness.run(gw.path.decide(full))
        assert (lazy_decision.replica, lazy_decision.matched_blocks) == (
            decision.replica,
            decision.matched_blocks,
        )
        completed = harness.run(gw.path.complete(lazy))
        assert list(completed.token_ids) == ids
        assert completed.block_hashes == full.block_hashes
        assert completed.num_tokens == full.num_tokens
        harness.run(gw.path.record_placement(full, decision))
        for url in harness.urls:
            got = recorded_lazily._replicas.get(url)
            want = gw.index._replicas.get(url)
            assert (got.order() if got else []) == (want.order() if want else [])
        # the next turn finds this one's new segment in the segment cache, as before
        with renderer.cache_scope(salt):
            assert renderer.cache_info()["entries"] > 0

    check()
    # Both ways were exercised: decided on the head, and waited for the rest (about one
    # example in seven is decided on its head; CI runs hypothesis derandomized).
    assert seen["head"] >= 2 and seen["full"] >= 1, seen


def test_a_head_is_taken_only_past_enough_new_text(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short new user turn is tokenized whole (nothing to gain), and so is one no longer
    than the gateway's minimum rest (cheaper now than deferred); a longer one is cut."""
    gw, renderer = harness.gw, harness.renderer
    short = body(SYSTEMS[0], [], "hello there", None)
    long_ = body(SYSTEMS[0], [], "refund policy " * 200, None)  # 2,800 new characters

    def lazily(raw: bytes, min_rest: int) -> RoutedRequest:
        monkeypatch.setattr(gw.path, "_lazy_min_rest", lambda renderer: min_rest)
        renderer.clear_cache()
        harness.run(gw.path.prepare(short, {}, "chat", "warm", tenant="t"))  # system prompt cached
        return harness.run(gw.path.prepare(raw, {}, "chat", "l", tenant="t", lazy=True))

    assert tail_of(lazily(short, 0)) is None
    whole = lazily(long_, 3000)
    assert tail_of(whole) is None and list(whole.token_ids) == harness.ids(long_)
    assert tail_of(lazily(body(SYSTEMS[0], [], "refund policy " * 250, None), 3000))
    rr = lazily(long_, 0)
    tail = tail_of(rr)
    assert tail is not None and len(rr.token_ids) < len(harness.ids(long_))
    # the cached prefix (the short prompt less its 7 tokens from "hello" on), then more
    # than a block of the new turn: the block that straddles the two is in the head
    assert len(rr.token_ids) - (len(harness.ids(short)) - 7) > BLOCK
    assert rr.num_tokens > len(rr.token_ids)
    harness.run(gw.path.complete(rr))


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_over_http_a_new_user_turn_routes_on_its_head_and_is_recorded_whole(
    fleet: Any, gateway: Any, reference_renderer: Renderer
) -> None:
    """Two turns of a conversation through the served gateway: the second turn's new user
    message is decided on the head, the replica's prefix cache confirms the prediction, and
    the index and metrics end up with the whole prompt (what the replica computed)."""
    from tests.helpers import cached_tokens, post, wait_for

    replicas = await fleet(3, block_size=BLOCK)
    gw = await gateway([r.url for r in replicas], block_size=BLOCK)
    system = SYSTEMS[0]
    first = json.loads(body(system, [], "Where is my refund? " * 30, None))
    # Past the minimum rest a head is worth (fastokens: the 16k characters it encodes in
    # place), so the rest goes to a worker thread: the default path for a long new turn.
    second_user = "And what does the warranty cover for a broken screen, please? " * 300
    async with aiohttp.ClientSession() as s:
        status, headers, answer = await post(s, gw.url + "/v1/chat/completions", first)
        assert status == 200
        holder = headers["x-prefix-router-replica"]
        reply = answer["choices"][0]["message"]["content"]
        second = json.loads(
            body(system, [(first["messages"][1]["content"], reply)], second_user, None)
        )
        status, headers, answer = await post(s, gw.url + "/v1/chat/completions", second)
        assert status == 200
        assert headers["x-prefix-router-replica"] == holder
        predicted = int(headers["x-prefix-router-cached-blocks"]) * BLOCK
        assert predicted > 0 and cached_tokens(answer) >= predicted
        ids = reference_renderer.tokenize_chat(second)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        want = block_hashes(ids, BLOCK, namespace=MODEL)
        index = gw.gateway.index

        async def recorded() -> bool:
            return set(want) <= index.blocks(holder)

        await wait_for(recorded, what="the whole prompt's blocks in the index")
        both = len(reference_renderer.tokenize_chat(first)) + len(ids)
        metrics = ""

        async def counted() -> bool:  # the exact counts, once the tails are tokenized
            nonlocal metrics
            async with s.get(gw.url + "/metrics") as r:
                metrics = await r.text()
            return _sample(metrics, "prefix_router_prompt_tokens_total") == both

        await wait_for(counted, what="the prompt-tokens metric to count both prompts exactly")
    assert _sample(metrics, 'prefix_router_lazy_tail_decisions_total{on="head"}') >= 1
