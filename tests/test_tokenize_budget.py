"""A per-request tokenize budget (issue 18): new prompt text is BPE-encoded in pieces with
the thread's CPU time and the prompt's token count checked between them, so one request
with megabytes of new text is refused after a bounded share of what encoding it costs,
and the ids of what is accepted are exactly the whole-text tokenization."""

from __future__ import annotations

import json
import random
import time

import aiohttp
import pytest

from router.core.errors import APIError
from router.prompt import chunks, scope
from tests.helpers import chat_body, post

# Words with separators inside them: newlines, tabs, CJK punctuation, a combining accent.
SOURCE = (
    "the quick brown fox, jumps over 12 lazy dogs. invoice ledger (audit) balance!\n"
    "élan naïve e\u0301 中文，文字。 日本語、テキスト？ tab\there  double  space 'll 're x\r\ny"
)
WORDS = SOURCE.split(" ")


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@pytest.mark.parametrize("seed", range(6))
def test_budgeted_encoding_is_exactly_the_whole_text_encoding(renderer, monkeypatch, seed):
    """Small pieces, so the text holds hundreds of cuts of every kind."""
    monkeypatch.setattr(chunks, "CHUNK_CHARS", 64 + 37 * seed)
    tok = renderer._segments
    assert tok._chunkable  # the bundled Qwen3 tokenizer is the kind the cuts were proven for
    rng = random.Random(seed)
    sample = text(rng, 20_000) + "x" * 500 + " " * 300 + text(rng, 3_000)  # and long runs
    whole = list(tok._backend.encode(sample, add_special_tokens=False).ids)
    with scope.budget(60.0):
        assert list(tok._encode_split(sample, use_cache=False)) == whole


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        pytest.param("natural", 400, "context_length_exceeded", id="3.9M characters of words"),
        pytest.param("a", 400, "context_length_exceeded", id="3.9M of one letter"),
        pytest.param("7", 400, "context_length_exceeded", id="3.9M digits"),
    ],
)
async def test_a_huge_new_prompt_is_refused_before_it_is_all_encoded(
    fleet, gateway, renderer, content, status, code
):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    chars = 3_900_000
    message = text(random.Random(7), chars) if content == "natural" else content * chars
    async with aiohttp.ClientSession() as s:
        t0 = time.process_time()
        got, _, body = await post(s, gw.url + "/v1/chat/completions", chat_body(message))
        refused_cpu = time.process_time() - t0
    assert got == status and body["error"]["code"] == code, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if content != "natural":
        return
    # What encoding it all costs, for comparison (a CPU-time ratio, with a wide margin).
    t0 = time.thread_time()
    renderer._segments._backend.encode(message, add_special_tokens=False)
    whole_cpu = time.thread_time() - t0
    assert refused_cpu < 0.5 * whole_cpu, (refused_cpu, whole_cpu)


async def test_the_cpu_budget_refuses_what_fits_the_context_but_costs_too_much(fleet, gateway):
    """3.9M spaces are ~30,000 tokens (tokens of up to 128 spaces): within a 40,960-token
    context, but seconds of BPE; a small budget refuses it with a 413 that says what to do."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], max_tokenize_cpu_s=0.2)
    async with aiohttp.ClientSession() as s:
        got, _, body = await post(
            s, gw.url + "/v1/chat/completions", chat_body("x" + " " * 3_900_000 + "y")
        )
        assert got == 413 and body["error"]["code"] == "prompt_too_expensive", body
        assert "max_tokenize_cpu_s" in body["error"]["message"]
        # An ordinary request is untouched by the budget.
        assert (await post(s, gw.url + "/v1/chat/completions", chat_body("hello")))[0] == 200


def test_no_budget_outside_the_block_and_cached_text_costs_nothing(renderer):
    tok = renderer._segments
    long_text = text(random.Random(3), 200_000)
    tok.encode(long_text, add_special_tokens=False)  # cached now (one segment)
    with scope.budget(1e-9):  # spent at once: only new text would be refused
        assert len(tok.encode(long_text, add_special_tokens=False)) > 0
        with pytest.raises(APIError) as refused:
            tok.encode(long_text + " more", add_special_tokens=False)
        assert refused.value.status == 413
    assert len(tok.encode(long_text + " more", add_special_tokens=False)) > 0  # no budget


@pytest.mark.parametrize(
    "char",
    [
        pytest.param(" ", id="spaces"),
        pytest.param("a", id="one long word"),
        pytest.param("\n", id="newlines"),
        pytest.param("!", id="symbols"),
        pytest.param("7", id="digits"),
        pytest.param("中", id="CJK"),
    ],
)
async def test_the_cpu_budget_bounds_every_input_class(fleet, gateway, char):
    """3.9M characters of one class, within a 10M-token context so only the CPU budget
    (the default 2 s) can refuse them: refused having used at most 1.25x the budget of this
    process's CPU (gateway and client together). A run with no cut can only be BPE-encoded
    whole, which no check interrupts: spaces took 4.1-4.6 s and one long word 3.5 s, when
    that whole encode started once pieces of the run had fit the budget."""
    replicas = await fleet(1, max_model_len=10_000_000)
    gw = await gateway([replicas[0].url])
    budget = gw.gateway.config.limits.max_tokenize_cpu_s
    body = json.dumps(chat_body(char * 3_900_000))
    async with aiohttp.ClientSession() as s:
        t0 = time.process_time()
        got, _, answer = await post(s, gw.url + "/v1/chat/completions", body)
        used = time.process_time() - t0
    assert got == 413 and answer["error"]["code"] == "prompt_too_expensive", answer
    assert used < 1.25 * budget, (used, budget)
