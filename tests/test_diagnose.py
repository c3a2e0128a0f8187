"""Diagnostics: why the hit rate is low, and where. The seeds' scenarios through the live
endpoint (real sockets, simulated replicas) and through the offline command; expected
divergence points are computed here, independently, from the renderer's token ids."""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import aiohttp
import pytest

from loadtest.workloads import collect_specs, preamble
from router.core.blocks import block_hashes as chain_hashes
from router.ops import diagnose
from router.ops.diagnose import Sample, Window, analyze, attribute, find_resync, first_divergence
from tests.helpers import LONG_SYSTEM, chat_body, post

MODEL = "Qwen/Qwen3-0.6B"
KEY = {"X-Admin-Key": "k"}
APP = "X-Prefix-Router-App"


# -- scenario builders ------------------------------------------------------------------------
def timestamp_bodies(n: int = 10) -> list[dict[str, Any]]:
    """A timestamp at the top of the system prompt (the seeds' Tuesday deploy)."""
    return [
        chat_body(
            f"Question number {i}: where is my invoice?",
            system=f"Current date and time: 2026-10-27T14:03:{22 + i:02d}Z\n" + LONG_SYSTEM,
        )
        for i in range(n)
    ]


TOOL_NAMES = ["get_weather", "search_documents", "create_ticket", "lookup_order"]


def tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Call {name.replace('_', ' ')} for the customer.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }


def tool_bodies(n: int = 10) -> list[dict[str, Any]]:
    """The same tools, serialised in an unstable order (the first one always changes)."""
    rng = random.Random(7)
    out, first = [], None
    for i in range(n):
        names = list(TOOL_NAMES)
        while True:
            rng.shuffle(names)
            if names[0] != first:
                break
        first = names[0]
        out.append(
            chat_body(f"Customer question {i}?", system=LONG_SYSTEM, tools=[tool(x) for x in names])
        )
    return out


def preamble_bodies(position: str) -> list[dict[str, Any]]:
    w = preamble(position, conversations=2, turns=4, system_words=150, tools=2, max_tokens=4)
    return [s.make_body() for s in collect_specs(w)]


def eviction_bodies(rounds: int = 4, docs: int = 4) -> list[dict[str, Any]]:
    """Four long documents behind a shared header, cycled: a small pool evicts each one before
    it comes round again."""
    header = "You are the ACME support assistant. Answer only from the document below. " * 3
    texts = [
        f"Document {d}. "
        + " ".join(f"clause {d}.{k} says item {k * (d + 3)} ships" for k in range(60))
        for d in range(docs)
    ]
    return [
        chat_body(f"Round {r}: summarise.", system=header + "\n\n" + texts[d])
        for r in range(rounds)
        for d in range(docs)
    ]


def divergences(renderer: Any, bodies: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(first differing index, len previous, len current) of consecutive prompts."""
    ids = [renderer.tokenize_chat(b) for b in bodies]
    out = []
    for a, b in zip(ids, ids[1:], strict=False):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        out.append((i, len(a), len(b)))
    return out


def mode(xs: list[int]) -> int:
    c = collections.Counter(xs)
    return max(c.items(), key=lambda kv: (kv[1], -kv[0]))[0]


async def send_all(session, url, bodies, app):
    for b in bodies:
        status, _, body = await post(session, url + "/v1/chat/completions", b, {APP: app})
        assert status == 200, body


async def get_report(session, url, **query) -> tuple[int, Any]:
    headers = query.pop("headers", KEY)
    async with session.get(url + "/admin/diagnostics", params=query, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


# -- pure core --------------------------------------------------------------------------------
def test_first_divergence_and_resync():
    a = list(range(100, 200))
    b = list(a)
    b[37] = 5
    assert first_divergence(a, b) == 37
    assert first_divergence(a, a[:50]) == 50
    assert first_divergence([], a) == 0
    # a volatile span of different lengths, then the prompts agree again for 40 tokens
    prev = [1] * 10 + [7, 8, 9] + list(range(1000, 1040))
    cur = [1] * 10 + [6] + list(range(1000, 1040))
    d = first_divergence(prev, cur)
    assert d == 10
    assert find_resync(prev, cur, d, min_run=16) == (13, 11, 40)
    assert find_resync(prev, [1] * 10 + [6] * 40, d) is None
    # with chained hashes the differing block is found first, then the token inside it
    h1, h2 = chain_hashes(a, 16), chain_hashes(b, 16)
    assert first_divergence(a, b, a_hashes=h1, b_hashes=h2, block_size=16) == 37
    assert first_divergence(a, a[:50], a_hashes=h1, b_hashes=h1[:3], block_size=16) == 50


def test_attribution_waterfall_adds_up():
    for n, ideal, reusable, delivered in [
        (100, 80, 80, 10),  # eviction
        (100, 80, 16, 16),  # placement
        (100, 0, 0, 0),  # layout
        (100, 32, 32, 64),  # beyond the window's ideal
        (100, 80, None, None),  # offline
    ]:
        a = attribute(n, ideal, reusable, delivered)
        total = sum(
            a[k] or 0 for k in ("delivered", "layout", "placement", "capacity", "unreported")
        )
        assert total == n, (n, ideal, reusable, delivered, a)
    assert attribute(100, 80, 80, 10)["capacity"] == 70
    assert attribute(100, 80, 16, 16)["placement"] == 64
    assert attribute(100, 0, 0, 0)["layout"] == 100
    assert attribute(100, 32, 32, 64)["beyond_ideal"] == 32


def test_ideal_follows_vllm_rules():
    bs = 4
    base = list(range(10, 30))  # 20 tokens = 5 full blocks
    samples = [Sample(base, bs), Sample(base, bs), Sample(base[:9] + [0] + base[10:], bs)]
    rep = analyze(samples)
    # the repeat hits 4 blocks (capped at n - 1 tokens), the third request 2 (diverges at 9)
    assert rep["tokens"]["ideal"] == 16 + 8
    assert [b["count"] for b in rep["divergence"]["buckets"][:2]] == [1, 1]  # at 9, at 20
    assert rep["divergence"]["extending_pairs"] == 1
    salted = analyze([Sample(base, bs, cache_salt="a"), Sample(base, bs, cache_salt="b")])
    assert salted["tokens"]["ideal"] == 0
    assert [x["kind"] for x in salted["suggestions"]] == ["cache_key_differs"]


def test_decode_bound_flag():
    ids = list(range(200))
    busy = analyze(
        [Sample(ids, 16, completion_tokens=2000), Sample(ids, 16, completion_tokens=2000)]
    )
    assert busy["decode_bound"]["flag"] and busy["decode_bound"]["basis"] == "completion_tokens"
    assert "decode-bound" in busy["verdict"]["message"]
    quick = analyze([Sample(ids, 16, completion_tokens=20), Sample(ids, 16, max_tokens=9000)])
    assert not quick["decode_bound"]["flag"]
    assert analyze([Sample(ids, 16, max_tokens=4000)])["decode_bound"]["flag"]  # upper bound


def test_window_is_bounded():
    t = [0.0]
    w = Window(max_requests=5, max_age_s=10.0, max_groups=3, pairs_per_group=4, clock=lambda: t[0])
    for i in range(50):
        t[0] = float(i)
        w.add(Sample(list(range(64)) + [i], 16, tenant=f"t{i % 7}", replica="r"))
    assert len(w.records) <= 5
    assert len(w.groups) == 3
    assert all(len(g.pairs) <= 4 for g in w.groups.values())
    t[0] = 1000.0
    rep = w.report()
    assert rep["scope"]["requests"] == 0 and not w.records
    # the block-hash maps drop whole generations instead of growing without bound
    w = Window(max_blocks=40, clock=lambda: 0.0)
    for i in range(2000):
        w.add(Sample(list(range(i, i + 65)), 16, replica=f"r{i % 3}"))
        assert sum(r.blocks for r in w.records) <= 40
    assert sum(len(m) for m in w._ideal.values()) <= 2 * 40
    assert sum(len(m) for m in w._placed.values()) <= 2 * 40
    # and what is in the window is still found: a repeat of the last prompt hits
    rec = w.add(Sample(list(range(1999, 2064)), 16, replica="r1"))
    assert rec.ideal == 64 and rec.replayed == 64


# -- live: the gateway endpoint ---------------------------------------------------------------
async def test_admin_key_required(fleet, gateway):
    replicas = await fleet(1)
    off = await gateway([replicas[0].url])
    on = await gateway([replicas[0].url], admin_key="k")
    async with aiohttp.ClientSession() as s:
        status, body = await get_report(s, off.url, headers=KEY)
        assert status == 404, body
        assert (await get_report(s, on.url, headers={}))[0] == 401
        assert (await get_report(s, on.url, headers={"X-Admin-Key": "nope"}))[0] == 401
        status, body = await get_report(s, on.url)
        assert status == 200 and body["scope"]["requests"] == 0
        assert (await get_report(s, on.url, format="xml"))[0] == 400


async def test_live_timestamp_at_top_is_layout(fleet, gateway, renderer):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], admin_key="k")
    bodies = timestamp_bodies()
    expected = divergences(renderer, bodies)
    want = mode([d for d, _, _ in expected])
    async with aiohttp.ClientSession() as s:
        await send_all(s, gw.url, bodies, "support")
        status, rep = await get_report(s, gw.url, app="support")
        assert status == 200, rep
        assert rep["scope"]["requests"] == len(bodies)
        assert rep["verdict"]["cause"] == "layout"
        lost = rep["tokens"]["lost"]
        assert lost["layout"]["share"] > 0.9
        assert lost["layout"]["tokens"] > 10 * (lost["placement"]["tokens"] + 1)
        assert rep["hit_rates"]["ideal"] < 0.1
        culprit = rep["divergence"]["culprits"][0]
        assert culprit["index"] == want
        assert culprit["block"] == want // 16 <= 1  # within the first block or two
        assert "Current date and time: 2026-10-27T14:03:" in culprit["line"]
        assert "timestamp" in culprit["kind"]
        assert rep["divergence"]["buckets"][diagnose.bucket_of(want)]["count"] == len(expected)

        # redaction: positions and counts, no text
        status, red = await get_report(s, gw.url, app="support", redact="1")
        assert status == 200
        raw = json.dumps(red)
        assert "Current date" not in raw and "2026" not in raw and "invoice" not in raw
        assert red["divergence"]["culprits"][0]["index"] == want
        assert "line" not in red["divergence"]["culprits"][0]

        status, text = await get_report(s, gw.url, app="support", format="text")
        assert status == 200 and "first divergence" in text and "Current date" in text
        status, text = await get_report(s, gw.url, format="text", redact="1")
        assert "Current date" not in text

        async with s.get(gw.url + "/metrics") as r:
            metrics = await r.text()
        assert f'prefix_router_ideal_hit_rate{{model="{MODEL}"}}' in metrics
        for name in ("available", "captured", "delivered", "predicted", "measured"):
            assert f'prefix_router_{name}_hit_rate{{model="{MODEL}"}}' in metrics


async def test_live_preamble_positions(fleet, gateway, renderer):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], admin_key="k")
    reports, medians = {}, {}
    async with aiohttp.ClientSession() as s:
        for position in ("first", "after_system", "last"):
            bodies = preamble_bodies(position)
            idx = sorted(d for d, _, _ in divergences(renderer, bodies))
            medians[position] = idx[len(idx) // 2]
            await send_all(s, gw.url, bodies, position)
            status, reports[position] = await get_report(s, gw.url, app=position)
            assert status == 200
    for position, rep in reports.items():
        assert rep["divergence"]["median_index"] == medians[position], position
    assert medians["first"] < 16 < medians["after_system"] < medians["last"]
    ideal = {p: r["hit_rates"]["ideal"] for p, r in reports.items()}
    assert ideal["first"] < ideal["after_system"] < ideal["last"], ideal
    first = reports["first"]
    assert first["verdict"]["cause"] == "layout"
    assert "req" in first["divergence"]["culprits"][0]["line"]
    # the preamble is a short volatile span: moving it later unlocks the system prompt
    move = [x for x in first["suggestions"] if x["kind"] == "move_volatile_span"][0]
    assert move["start"] < 16 and move["unlock_tokens_per_request"] > 500
    assert "req" in move["line"]


async def test_live_unstable_tool_order(fleet, gateway, renderer):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], admin_key="k")
    bodies = tool_bodies()
    expected = divergences(renderer, bodies)
    async with aiohttp.ClientSession() as s:
        await send_all(s, gw.url, bodies, "agent")
        status, rep = await get_report(s, gw.url, app="agent")
    assert status == 200
    culprit = rep["divergence"]["culprits"][0]
    assert culprit["index"] == mode([d for d, _, _ in expected])
    # the divergence is in the tools section, after the whole system prompt
    system_len = len(renderer.tokenize_chat(chat_body("x")))
    assert culprit["index"] > system_len - 20
    assert "tool_order" in culprit["kind"]
    shown = culprit["after_current"] + culprit["after_previous"]
    assert sum(name in shown for name in TOOL_NAMES) >= 2
    assert any(x["kind"] == "stable_tool_order" for x in rep["suggestions"])
    assert rep["verdict"]["cause"] == "layout"


async def test_live_small_pool_is_capacity(fleet, gateway, renderer):
    replicas = await fleet(1, num_gpu_blocks=64, max_tokens_default=4)
    gw = await gateway([replicas[0].url], admin_key="k")
    bodies = eviction_bodies()
    n_blocks = len(renderer.tokenize_chat(bodies[0])) // 16
    assert 4 * n_blocks > 64 > n_blocks + 4  # one fits, the cycle does not
    async with aiohttp.ClientSession() as s:
        await send_all(s, gw.url, bodies, "rag")
        await asyncio_sleep(0.5)  # one metrics scrape for the replica counters
        status, rep = await get_report(s, gw.url, app="rag")
    assert status == 200
    lost = rep["tokens"]["lost"]
    assert rep["verdict"]["cause"] == "capacity", rep["verdict"]
    assert lost["capacity"]["tokens"] > lost["layout"]["tokens"]
    assert lost["placement"]["tokens"] == 0
    assert rep["hit_rates"]["ideal"] > 0.6
    assert rep["hit_rates"]["delivered"] < 0.3
    assert rep["hit_rates"]["ideal"] - rep["hit_rates"]["delivered"] > 0.4
    counters = rep["hit_rates"].get("replica_counters")
    assert counters is None or counters["hit_rate"] < 0.3


async def test_live_round_robin_is_placement(fleet, gateway):
    replicas = await fleet(3)
    gw = await gateway([r.url for r in replicas], admin_key="k", policy="round_robin")
    bodies = [chat_body(f"Question {i}: what is my plan?") for i in range(9)]
    async with aiohttp.ClientSession() as s:
        await send_all(s, gw.url, bodies, "rr")
        status, rep = await get_report(s, gw.url, app="rr")
    assert status == 200
    lost = rep["tokens"]["lost"]
    # the 2nd and 3rd requests went to replicas that had never seen the shared prefix
    assert lost["placement"]["tokens"] >= 2 * 16 * (len(LONG_SYSTEM) // 8 // 16)
    assert lost["placement"]["tokens"] > lost["capacity"]["tokens"]
    assert rep["verdict"]["cause"] == "placement", rep["verdict"]


async def asyncio_sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


# -- offline: prefix-router diagnose FILE -----------------------------------------------------
def run_offline(tmp_path, capsys, tokenizer_dir, bodies, *extra: str) -> Any:
    path = tmp_path / "capture.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    rc = diagnose.main([str(path), "--tokenizer", tokenizer_dir, *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out) if "--json" in extra else out


def test_offline_timestamp(tmp_path, capsys, tokenizer_dir, renderer):
    bodies = timestamp_bodies()
    want = mode([d for d, _, _ in divergences(renderer, bodies)])
    rep = run_offline(tmp_path, capsys, tokenizer_dir, bodies, "--json")
    culprit = rep["divergence"]["culprits"][0]
    assert culprit["index"] == want
    assert "Current date and time: 2026-10-27T14:03:" in culprit["line"]
    assert rep["verdict"]["cause"] == "layout"
    assert rep["hit_rates"]["delivered"] is None
    text = run_offline(tmp_path, capsys, tokenizer_dir, bodies)
    assert "Current date and time" in text and f"at token {want}" in text
    red = run_offline(tmp_path, capsys, tokenizer_dir, bodies, "--redact")
    assert "Current date" not in red and f"at token {want}" in red


def test_offline_preamble_positions(tmp_path, capsys, tokenizer_dir, renderer):
    ideal, med = {}, {}
    for position in ("first", "after_system", "last"):
        bodies = preamble_bodies(position)
        idx = sorted(d for d, _, _ in divergences(renderer, bodies))
        rep = run_offline(tmp_path, capsys, tokenizer_dir, bodies, "--json")
        assert rep["divergence"]["median_index"] == idx[len(idx) // 2]
        ideal[position] = rep["hit_rates"]["ideal"]
        med[position] = rep["divergence"]["median_index"]
    assert ideal["first"] < ideal["after_system"] < ideal["last"]
    assert med["first"] < med["after_system"] < med["last"]


def test_offline_tools_and_group_by(tmp_path, capsys, tokenizer_dir, renderer):
    bodies = tool_bodies(8)
    for i, b in enumerate(bodies):
        b["user"] = f"u{i % 2}"
    rep = run_offline(tmp_path, capsys, tokenizer_dir, bodies, "--json", "--group-by", "user")
    assert {g["app"] for g in rep["groups"]} == {"u0", "u1"}
    assert rep["divergence"]["pairs"] == len(bodies) - 2  # consecutive within each group
    culprit = rep["divergence"]["culprits"][0]
    per_group = [bodies[0::2], bodies[1::2]]
    expected = [d for g in per_group for d, _, _ in divergences(renderer, g)]
    assert culprit["index"] == mode(expected)
    assert any(name in culprit["after_current"] for name in TOOL_NAMES)


def test_offline_bad_lines_are_skipped(tmp_path, capsys, tokenizer_dir):
    path = tmp_path / "capture.jsonl"
    path.write_text("not json\n" + json.dumps(chat_body("hi")) + "\n")
    assert diagnose.main([str(path), "--tokenizer", tokenizer_dir, "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["scope"]["skipped_lines"] == 1
    assert "skipped line 1" in cap.err


@pytest.mark.parametrize("argv", [["diagnose", "--help"]])
def test_cli_delegates(argv, capsys):
    from router.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "--group-by" in capsys.readouterr().out
