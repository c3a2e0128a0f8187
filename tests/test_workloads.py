"""Workload generators (deterministic, shaped as documented) and the ideal hit-rate calculator."""

from __future__ import annotations

import json
import math

import pytest

from loadtest import trace as tr
from loadtest import workloads as wl
from loadtest.ideal import IdealCache, IdealRequest, ideal_hit_rate
from loadtest.metrics_scrape import delta, fleet_hit_rate, from_text, parse_prometheus
from loadtest.runner import default_renderer
from router.core.blocks import block_hashes


@pytest.fixture(scope="module")
def renderer():
    return default_renderer()


def _answers(spec: wl.RequestSpec) -> str:
    return f"Answer {spec.session} turn {spec.turn}: the setting is in the dashboard."


def _dump(workload: wl.Workload) -> str:
    specs = wl.collect_specs(workload, _answers)
    starts = [(s.id, s.group, s.start_s, s.turns) for s in workload.sessions]
    return json.dumps(
        [starts, [(s.endpoint, s.group, s.turn, s.delay_s, s.make_body()) for s in specs]],
        sort_keys=True,
    )


def _diverge(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# ---------------------------------------------------------------------------------------------
# determinism


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("preamble", {"position": "after_system", "conversations": 3, "turns": 3}),
        ("multi_tenant", {"conversations": 12, "tenants": 3}),
        ("trace", {"max_requests": 8}),
        ("prefix_repetition", {"num_prefixes": 3, "suffixes_per_prefix": 4, "rate": 5.0}),
    ],
)
def test_workloads_are_deterministic_from_the_seed(name, kwargs):
    a = _dump(wl.build(name, seed=7, **kwargs))
    b = _dump(wl.build(name, seed=7, **kwargs))
    c = _dump(wl.build(name, seed=8, **kwargs))
    assert a == b
    assert a != c


def test_unknown_workload_and_position_are_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        wl.build("nope")
    with pytest.raises(ValueError, match="position"):
        wl.preamble("middle")


# ---------------------------------------------------------------------------------------------
# preamble


def test_preamble_is_about_eleven_tokens_and_unique(renderer):
    w = wl.preamble("last", conversations=4, turns=5)
    pres = [s.meta["preamble"] for s in wl.collect_specs(w, _answers)]
    assert len(set(pres)) == len(pres) == 20
    lengths = [len(renderer.encode(p, add_special_tokens=False)) for p in pres]
    assert all(9 <= n <= 14 for n in lengths), lengths


def _rendered(renderer, position):
    w = wl.preamble(position, conversations=2, turns=3, system_words=200, tools=2)
    specs = wl.collect_specs(w, _answers)
    return (
        specs,
        [renderer.render_chat(s.make_body()) for s in specs],
        [s.prompt_token_ids(renderer) for s in specs],
    )


def test_preamble_first_breaks_block_zero(renderer):
    specs, texts, ids = _rendered(renderer, "first")
    for s, text in zip(specs, texts, strict=True):
        pre = s.meta["preamble"]
        assert text.index(pre) < text.index("You are the support assistant")
        assert text.index(pre) < 32
    # every pair of requests differs inside block 0, so nothing can ever be shared
    first_blocks = {tuple(i[:16]) for i in ids}
    assert len(first_blocks) == len(ids)
    assert ideal_hit_rate([IdealRequest(k, i) for k, i in enumerate(ids)], 16).hits == 0


def test_preamble_after_system_sits_between_tools_and_conversation(renderer):
    specs, texts, ids = _rendered(renderer, "after_system")
    shared = renderer.render_chat(
        {
            "messages": specs[0].make_body()["messages"][:1],
            "tools": specs[0].make_body()["tools"],
            "add_generation_prompt": False,
        }
    )
    n_shared = len(renderer.encode(shared, add_special_tokens=False))
    for s, text in zip(specs, texts, strict=True):
        pre = s.meta["preamble"]
        assert text.startswith(shared)
        assert text.index("</tools>") < text.index(pre) < text.index("<|im_start|>user")
    # any two requests agree on the system prompt + tools and diverge inside the preamble
    # (``<|im_start|>system\n`` + ~11 tokens after the shared part)
    for a in ids:
        for b in ids:
            if a is not b:
                assert n_shared <= _diverge(a, b) < n_shared + 3 + 14


def test_preamble_last_keeps_the_conversation_a_prefix(renderer):
    specs, texts, ids = _rendered(renderer, "last")
    for s, text in zip(specs, texts, strict=True):
        pre = s.meta["preamble"]
        assert text.index(pre) > text.rindex("<|im_start|>user")
    # within a conversation each turn's prompt is a prefix of the next one's (with the answer)
    by_conv: dict[str, list[int]] = {}
    for s, i in zip(specs, ids, strict=True):
        if s.session in by_conv:
            prev = by_conv[s.session]
            assert i[: len(prev)] == prev
            assert renderer.decode(i[len(prev) :]).startswith(
                f"Answer {s.session} turn {s.turn - 1}"
            )
        by_conv[s.session] = i


def test_preamble_positions_order_the_ideal_hit_rate(renderer):
    rates = {}
    for pos in wl.PREAMBLE_POSITIONS:
        w = wl.preamble(pos, conversations=3, turns=5, system_words=300, tools=3)
        specs = wl.collect_specs(w, _answers)
        reqs = []
        for k, s in enumerate(specs):
            out = renderer.encode(_answers(s), add_special_tokens=False)
            reqs.append(IdealRequest(2 * k, s.prompt_token_ids(renderer), 2 * k + 1, out))
        rates[pos] = ideal_hit_rate(reqs, 16).hit_rate
    assert rates["first"] == 0.0
    assert 0.2 < rates["after_system"] < rates["last"] < 1.0
    assert rates["last"] > 0.8


# ---------------------------------------------------------------------------------------------
# multi_tenant


def test_multi_tenant_tenants_have_distinct_system_prompts(renderer):
    w = wl.multi_tenant(tenants=4, conversations=40, seed=3)
    specs = wl.collect_specs(w, _answers)
    systems: dict[str, str] = {}
    for s in specs:
        sys_msg = s.make_body()["messages"][0]
        assert sys_msg["role"] == "system"
        assert systems.setdefault(s.group, sys_msg["content"]) == sys_msg["content"]
    assert len(systems) == 4 and len(set(systems.values())) == 4
    # distinct from block 0 on: no tenant can hit another tenant's prompt
    heads = {
        g: renderer.tokenize_chat({"messages": [{"role": "system", "content": t}]})[:16]
        for g, t in systems.items()
    }
    assert len({tuple(h) for h in heads.values()}) == 4


def test_multi_tenant_turns_send_the_servers_answers_back():
    w = wl.multi_tenant(tenants=2, conversations=10, turns=(3, 4), seed=1)
    specs = wl.collect_specs(w, _answers)
    by_session: dict[str, list[wl.RequestSpec]] = {}
    for s in specs:
        by_session.setdefault(s.session, []).append(s)
    for turns in by_session.values():
        assert 3 <= len(turns) <= 4
        for prev, cur in zip(turns, turns[1:], strict=False):
            msgs = cur.make_body()["messages"]
            assert msgs[: len(prev.make_body()["messages"])] == prev.make_body()["messages"]
            assert {"role": "assistant", "content": _answers(prev)} in msgs
            assert cur.delay_s >= 0


def test_multi_tenant_arrivals_are_poisson_and_a_failed_turn_ends_the_conversation():
    w = wl.multi_tenant(conversations=400, rate=4.0, seed=2, tenant_skew=0.0)
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.05
    tenants = {s.group for s in w.sessions}
    assert len(tenants) == 4
    gen = w.sessions[0].script()
    next(gen)
    with pytest.raises(StopIteration):
        gen.send(None)


# ---------------------------------------------------------------------------------------------
# trace


def test_trace_blocks_are_fixed_per_hash_id():
    a = tr.trace_block(42, seed=0)
    assert len(a) == 512 and a.min() >= 1000 and a.max() < 100_000
    assert (a == tr.trace_block(42, seed=0)).all()
    assert not (a == tr.trace_block(43, seed=0)).all()
    assert not (a == tr.trace_block(42, seed=1)).all()


def test_trace_rows_share_exactly_their_common_hash_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 300, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 512, "output_length": 900, "hash_ids": [0]},
        {
            "timestamp": 3000,
            "input_length": 9000,
            "output_length": 1,
            "hash_ids": list(range(10, 28)),
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = wl.trace(path, time_scale=2.0, max_output_tokens=100, max_input_tokens=5000)
    specs = wl.collect_specs(w)
    assert len(specs) == 3 and "skipped 1 of 4" in w.warnings[0]
    ids = [s.prompt_token_ids() for s in specs]
    assert [len(i) for i in ids] == [1200, 1100, 512]
    assert ids[0][:1024] == ids[1][:1024] and ids[0][1024:1100] != ids[1][1024:1100]
    assert ids[2] == ids[0][:512]
    assert ids[0][:512] == tr.trace_block(0).tolist()
    assert ids[0][1024:] == tr.trace_block(2).tolist()[:176]
    assert [s.start_s for s in w.sessions] == [0.0, 0.25, 1.0]
    bodies = [s.make_body() for s in specs]
    assert [b["max_tokens"] for b in bodies] == [100, 5, 100]
    assert bodies[0]["prompt"] == ids[0] and specs[0].endpoint == "completions"
    assert [s.group for s in specs] == ["h1", "h1", "h0"]


def test_bundled_trace_is_the_mooncake_head():
    rows = tr.load_trace()
    assert len(rows) == 3000
    assert rows[0].hash_ids[:3] == (0, 1, 2) and rows[0].input_length == 6758
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in rows)
    w = wl.trace(max_requests=50, time_scale=10.0)
    assert w.planned_requests == 50
    assert tr.DEFAULT_TRACE.stat().st_size < 2_000_000


def test_trace_rejects_malformed_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        tr.load_trace(path)


# ---------------------------------------------------------------------------------------------
# prefix_repetition


def test_prefix_repetition_counts_and_shapes():
    w = wl.prefix_repetition(
        num_prefixes=4, suffixes_per_prefix=6, prefix_len=64, suffix_len=32, output_len=8, seed=5
    )
    specs = wl.collect_specs(w)
    assert len(specs) == w.planned_requests == 24
    assert any("flatters" in x for x in w.warnings)
    by_group: dict[str, list[list[int]]] = {}
    for s in specs:
        ids = s.prompt_token_ids()
        assert len(ids) == 96 and s.make_body()["max_tokens"] == 8
        by_group.setdefault(s.group, []).append(ids)
    assert len(by_group) == 4 and all(len(v) == 6 for v in by_group.values())
    for prompts in by_group.values():
        assert len({tuple(p[:64]) for p in prompts}) == 1
        assert len({tuple(p[64:]) for p in prompts}) == 6
    assert len({tuple(v[0][:64]) for v in by_group.values()}) == 4
    # shuffled, not grouped
    assert [s.group for s in specs] != sorted(s.group for s in specs)
    # ideal: all but the first of each group hit the whole prefix (64 = 4 blocks of 16)
    res = ideal_hit_rate([IdealRequest(k, s.prompt_token_ids()) for k, s in enumerate(specs)], 16)
    assert res.hits == 64 * 20 and res.queries == 96 * 24


# ---------------------------------------------------------------------------------------------
# ideal hit rate, hand-computed (block size 4)


def test_ideal_full_blocks_only_and_capped_at_num_tokens_minus_one():
    c = IdealCache(4)
    a = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    assert c.query(a) == 0
    assert c.query(a) == 8  # (10 - 1) // 4 = 2 blocks
    b = list(range(200, 208))  # exactly 2 blocks
    assert c.query(b) == 0
    assert c.query(b) == 4  # capped: the last token is recomputed, so only block 0 hits
    assert c.query([1, 2, 3]) == 0 and c.query([1, 2, 3]) == 0  # no full block at all
    assert (c.result.hits, c.result.queries) == (12, 10 + 10 + 8 + 8 + 3 + 3)


def test_ideal_stops_at_the_first_missing_block():
    a = list(range(12))
    b = a[:4] + [99] + a[5:]  # differs in block 1
    d = [99] + a[1:]  # differs in block 0 only: blocks 1, 2 same content
    e = a + [7, 7, 7, 7, 7]  # a, then more
    res = ideal_hit_rate([IdealRequest(t, x) for t, x in enumerate([a, b, d, e])], 4)
    assert res.per_request_hits == [0, 4, 0, 12]
    assert res.hits == 16 and res.queries == 12 * 3 + 17
    assert res.hit_rate == pytest.approx(16 / 53)


def test_ideal_caches_generated_tokens_at_completion():
    prompt, out = list(range(6)), [50, 51, 52, 53, 54]  # 11 tokens -> (11-1)//4 = 2 blocks
    follow = prompt + out + [60, 61, 62]  # 14 tokens
    after = ideal_hit_rate([IdealRequest(0.0, prompt, 1.0, out), IdealRequest(2.0, follow)], 4)
    assert after.per_request_hits == [0, 8]
    # sent before the first finished: only the prompt's one full block is there
    before = ideal_hit_rate([IdealRequest(0.0, prompt, 3.0, out), IdealRequest(2.0, follow)], 4)
    assert before.per_request_hits == [0, 4]
    # the last sampled token's KV is never computed: 4 + 4 tokens cache only block 0
    p2, o2 = [1, 2, 3, 4], [5, 6, 7, 8]
    res = ideal_hit_rate([IdealRequest(0, p2, 1, o2), IdealRequest(2, p2 + o2 + [9, 9, 9, 9])], 4)
    assert res.per_request_hits == [0, 4]


def test_ideal_salt_separates_and_instant_completion_does_not_self_hit():
    a = list(range(9))
    res = ideal_hit_rate(
        [
            IdealRequest(0, a, cache_salt="x"),
            IdealRequest(1, a, cache_salt="y"),
            IdealRequest(2, a, cache_salt="x"),
        ],
        4,
    )
    assert res.per_request_hits == [0, 0, 8]
    same = ideal_hit_rate([IdealRequest(0, a, 0, [1, 2, 3, 4])], 4)
    assert same.per_request_hits == [0] and same.hit_rate == 0.0
    assert ideal_hit_rate([], 16).hit_rate is None


def test_ideal_matches_router_block_hashes():
    ids = list(range(1000, 1100))
    c = IdealCache(16)
    c.insert(ids)
    assert c.blocks == set(block_hashes(ids, 16))


# ---------------------------------------------------------------------------------------------
# metrics parsing

_METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 600.0
vllm:prefix_cache_hits_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1500
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:cache_config_info{block_size="32",engine="0",model_name="m",num_gpu_blocks="4096"} 1.0
"""


def test_metrics_parse_and_delta():
    series = parse_prometheus(_METRICS)
    assert series["vllm:prefix_cache_queries_total"][1] == (
        {"engine": "1", "model_name": "Qwen/Qwen3-0.6B"},
        500.0,
    )
    m0 = from_text("http://r", _METRICS)
    assert (m0.queries, m0.hits, m0.prompt_tokens, m0.running) == (1500, 600, 1500, 3)
    assert (m0.block_size, m0.num_gpu_blocks) == (32, 4096)
    m1 = from_text("http://r", _METRICS.replace(" 1000.0", " 2000.0").replace(" 600.0", " 900"))
    d = delta(m0, m1)
    assert (d.queries, d.hits, d.hit_rate) == (1000, 300, 0.3)
    assert fleet_hit_rate([d]) == 0.3
    assert fleet_hit_rate([]) is None
