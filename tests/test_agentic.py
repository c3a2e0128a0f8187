"""The agentic session workload (loadtest.agentic): deterministic records, the shape of a
session and its sub-agents, compaction, the recorded-session format, the Mooncake converter,
and closed-loop timing over sockets against simulated replicas."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from loadtest import agentic as ag
from loadtest import workloads as wl
from loadtest.replica import SimConfig, run_replicas
from loadtest.report import ttft_by
from loadtest.runner import ClientTarget, default_renderer, ideal_renderer, run_workload
from loadtest.spec import RequestSpec

TRACE = Path(__file__).resolve().parents[1] / "loadtest" / "data"
TRACE_FILE = TRACE / "mooncake_conversation_trace_head3000.jsonl"


def answer(spec: RequestSpec) -> str:
    return f"Answer of {spec.session} request {spec.turn}."


def small(**kw: Any) -> wl.Workload:
    base: dict[str, Any] = dict(
        sessions=6, turns=(3, 6), system_words=300, subagent_share=0.4, messages_share=0.0
    )
    return wl.build("agentic", **{**base, **kw})


async def run_on_sims(workload: wl.Workload, replicas: int, **kw: Any) -> Any:
    """Run ``workload`` round robin over fast simulated replicas (no ideal computed)."""
    fast = SimConfig(prefill_tokens_per_s=2_000_000.0, decode_tokens_per_s=20_000.0)
    async with run_replicas(replicas, fast) as reps:
        return await run_workload(
            ClientTarget([r.url for r in reps], "round_robin"),
            workload,
            progress=False,
            compute_ideal=False,
            **kw,
        )


def bodies(workload: wl.Workload) -> list[str]:
    return [json.dumps(s.body, sort_keys=True) for s in ag.iter_specs(workload, answer)]


def test_the_workload_is_deterministic_from_its_seed() -> None:
    assert bodies(small(seed=3)) == bodies(small(seed=3))
    assert bodies(small(seed=3)) != bodies(small(seed=4))
    records = ag.agentic_records(seed=3, sessions=6)
    assert records == ag.agentic_records(seed=3, sessions=6)


def test_a_session_grows_its_context_and_forks_sub_agents_from_the_warm_prefix() -> None:
    workload = small(seed=1, sessions=10)
    specs = list(ag.iter_specs(workload, answer))
    assert len(specs) == workload.planned_requests
    by_script: dict[str, list[RequestSpec]] = defaultdict(list)
    for spec in specs:
        by_script[spec.session.split("/")[0]].append(spec)
    forks = 0
    for script in by_script.values():
        parents = [s for s in script if not s.meta["subagent"]]
        system, tools = parents[0].body["messages"][0], parents[0].body.get("tools")
        for before, after in zip(parents, parents[1:], strict=False):
            prev, now = before.body["messages"], after.body["messages"]
            # The next request repeats the whole conversation, then the answer calls a tool
            # and the tool's result comes back.
            assert now[: len(prev)] == prev
            assert now[len(prev)]["role"] == "assistant" and now[len(prev)]["tool_calls"]
            assert now[len(prev) + 1]["role"] == "tool"
        for i, spec in enumerate(script):
            if not spec.meta["subagent"]:
                continue
            # A sub-agent starts from the same system prompt and tools, with a task of its own.
            assert spec.body["messages"][0] == system and spec.body.get("tools") == tools
            assert spec.meta["parent"] == script[0].session
            nxt = script[i + 1]
            if not nxt.meta["subagent"]:  # its last answer is the parent's next tool result
                forks += 1
                tool = [m for m in nxt.body["messages"] if m["role"] == "tool"][-1]
                assert tool["content"] == answer(spec)
    assert forks >= 2
    # One system prompt per agent kind: sessions of a kind share it (the warm prefix).
    systems = defaultdict(set)
    for spec in specs:
        if not spec.meta["subagent"]:
            systems[spec.meta["agent"]].add(spec.body["messages"][0]["content"])
    assert len(systems) >= 2 and all(len(v) == 1 for v in systems.values())


def test_a_context_past_the_cap_is_compacted() -> None:
    record = {
        "session": "long",
        "kind": "coder",
        "system_words": 50,
        "context_cap_tokens": 3_000,
        "turns": [{"user_words": 20}] + [{"tool_result_words": 600} for _ in range(12)],
    }
    workload = ag.sessions_from_records("t", "t", [record])
    specs = list(ag.iter_specs(workload, answer))
    sizes = [ag.estimate_tokens(s.body["messages"]) for s in specs]
    assert max(sizes) <= 3_000 + 600 * ag.TOKENS_PER_WORD * 2  # the turn that passes it, at most
    compacted = [s for s in specs if s.body["messages"][1]["content"].startswith("Summary")]
    assert compacted and all(s.body["messages"][0]["role"] == "system" for s in compacted)


def test_recorded_sessions_replay_as_written(tmp_path: Path) -> None:
    records = ag.agentic_records(seed=2, sessions=4, subagent_share=0.5)
    path = tmp_path / "sessions.jsonl"
    ag.write_records(records, path)
    replayed = wl.build("sessions", path=str(path))
    assert bodies(replayed) == bodies(wl.build("agentic", seed=2, sessions=4, subagent_share=0.5))
    # Time scaling divides arrivals and think times.
    fast = wl.build("sessions", path=str(path), time_scale=10)
    slow_specs = list(ag.iter_specs(replayed, answer))
    fast_specs = list(ag.iter_specs(fast, answer))
    assert [s.delay_s / 10 for s in slow_specs] == pytest.approx([s.delay_s for s in fast_specs])
    assert [s.start_s / 10 for s in replayed.sessions] == pytest.approx(
        [s.start_s for s in fast.sessions]
    )
    # Given texts are sent as written.
    literal = {"session": "x", "system": "SYS", "turns": [{"user": "do it", "max_tokens": 5}]}
    ag.write_records([literal], path)
    (spec,) = ag.iter_specs(wl.build("sessions", path=str(path)), answer)
    assert spec.body["messages"] == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "do it"},
    ]
    path.write_text('{"session": "x", "turns": []}\n')
    with pytest.raises(ValueError, match="turns"):
        ag.read_records(path)


def test_mooncake_rows_are_linked_into_sessions_by_their_hash_id_chains() -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 700, "output_length": 9, "hash_ids": [0, 7]},
        # the first row's full blocks (0, 1) then its completed third block and more
        {"timestamp": 2000, "input_length": 2000, "output_length": 9, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 2500, "input_length": 900, "output_length": 9, "hash_ids": [0, 7, 8]},
    ]
    sessions, share = ag.link_sessions(rows)
    assert sessions == [[0, 2], [1, 3]] and share == 0.5
    records, _ = ag.from_mooncake(rows)
    first = records[0]
    assert first["start_s"] == 0.0 and len(first["turns"]) == 2
    assert first["turns"][1]["think_s"] == 2.0  # the gap between the two arrivals
    # A later turn sends the text of the blocks it adds.
    assert first["turns"][1]["user"] == "\n\n".join(ag.block_text(h) for h in (4,))
    # On the bundled trace every row starts with the same block (a shared system prompt):
    # that alone links nothing; about a quarter of the rows continue an earlier one.
    trace_rows = ag.read_mooncake(TRACE_FILE)
    sessions, share = ag.link_sessions(trace_rows)
    assert 0.2 < share < 0.35
    for chain in sessions:
        for a, b in zip(chain, chain[1:], strict=False):
            full = trace_rows[a]["hash_ids"][:-1]
            assert trace_rows[b]["hash_ids"][: len(full)] == full


async def test_closed_loop_a_turn_waits_for_the_previous_answer_and_its_think_time() -> None:
    workload = small(seed=5, sessions=4, think_time_s=0.05, rate=50.0)
    delays = {(s.session.split("/")[0], s.turn): s.delay_s for s in ag.iter_specs(workload, answer)}
    res = await run_on_sims(workload, 2, concurrency=8, max_seconds=60, request_timeout_s=20)
    assert res.ok == res.sent == workload.planned_requests
    by_script: dict[str, list[Any]] = defaultdict(list)
    for r in res.records:
        by_script[r.session.split("/")[0]].append(r)
    overlapped = False
    for script, records in by_script.items():
        records.sort(key=lambda r: r.turn)
        for before, after in zip(records, records[1:], strict=False):
            assert after.sent_s >= before.end_s + delays[(script, after.turn)] - 1e-3
        overlapped |= any(
            r.sent_s < records[0].end_s for s, o in by_script.items() if s != script for r in o
        )
    assert overlapped  # sessions ran concurrently, each closed-loop
    # The report buckets TTFT by prompt size and by the request's place in its session.
    by_turn, by_context = ttft_by([res], "turn"), ttft_by([res], "context")
    assert by_turn is not None and by_context is not None
    for table in (by_turn, by_context):
        rows = [line.split(" | ") for line in table.splitlines()[2:]]
        assert sum(int(row[2]) for row in rows) == res.ok
    assert by_turn.splitlines()[2].split(" | ")[1] == "0" and "| 1-3 |" in by_turn


def test_messages_sessions_send_the_same_history_through_anthropics_api() -> None:
    """A share of the sessions speak Messages; each such body is the very conversation its
    chat twin sends (the same sessions drawn with the share at 0), so the gateway and vLLM
    render it to the same tokens, and the sessions' shapes do not depend on the share."""
    from router.api.anthropic import to_chat

    mixed = ag.iter_specs(small(seed=2, sessions=12, messages_share=0.5), answer)
    plain = ag.iter_specs(small(seed=2, sessions=12), answer)
    renderer = default_renderer()
    apis = set()
    for m, c in zip(mixed, plain, strict=True):
        assert (m.session, m.turn, m.delay_s) == (c.session, c.turn, c.delay_s)
        apis.add(m.endpoint)
        if m.endpoint == "chat":
            assert m.body == c.body
            continue
        assert m.endpoint == "messages" and "system" in m.body and "tools" in m.body
        assert all(msg["role"] in ("user", "assistant") for msg in m.body["messages"])
        assert renderer.tokenize_chat(to_chat(m.body)) == renderer.tokenize_chat(c.body)
        assert m.prompt_token_ids(renderer) == c.prompt_token_ids(renderer)
        # The ideal's renderer (segment cache, prefix states) gives the whole path's ids.
        assert c.prompt_token_ids(ideal_renderer()) == renderer.tokenize_chat(c.body)
    assert apis == {"chat", "messages"}
    with pytest.raises(ValueError):
        ag.agentic_records(messages_share=1.5)


async def test_messages_sessions_run_closed_loop_through_the_anthropic_sdk() -> None:
    """Messages sessions go through the official SDK, streamed: each answer is read from the
    stream and comes back in the next turn's body, the first text delta timed, the replica's
    cache read counted."""
    workload = small(seed=6, sessions=3, messages_share=1.0, subagent_share=0.0, rate=50.0)
    res = await run_on_sims(workload, 1, concurrency=4, max_seconds=60, request_timeout_s=20)
    assert res.ok == res.sent == workload.planned_requests
    assert {r.endpoint for r in res.records} == {"messages"}
    by_session: dict[str, list[Any]] = defaultdict(list)
    for r in res.records:
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
        assert r.answer and r.completion_tokens and r.prompt_tokens
        by_session[r.session].append(r)
    for records in by_session.values():
        records.sort(key=lambda r: r.turn)
        for before, after in zip(records, records[1:], strict=False):
            sent = json.dumps(after.spec.body["messages"])
            assert json.dumps(before.answer)[1:-1] in sent  # the answer came back
            assert after.cached_tokens and after.cached_tokens > 0  # its history was cached


def test_simulated_replicas_for_agent_sessions_hold_a_context_past_the_cap() -> None:
    """``--sim`` replicas for agent workloads take a context up to the cap (vLLM would refuse
    a prompt past max_model_len with a 400) and hold several of them in KV."""
    from argparse import Namespace

    from loadtest.cli import sim_overrides

    cap = ag.agentic_records(sessions=1)[0]["context_cap_tokens"]
    for workload in ("agentic", "sessions"):
        kw = sim_overrides(Namespace(workload=workload))
        assert kw["max_model_len"] > cap + 4096
        assert kw["num_gpu_blocks"] * 16 >= 4 * cap
    assert sim_overrides(Namespace(workload="agentic", sim_gpu_blocks=100))["num_gpu_blocks"] == 100
    assert "max_model_len" not in sim_overrides(Namespace(workload="multi_tenant"))


async def test_messages_sessions_without_streaming_read_the_whole_answer() -> None:
    """``--no-stream``: the SDK's raw response parsed whole (no first token: no TTFT)."""
    workload = small(seed=8, sessions=2, turns=(2, 3), messages_share=1.0, subagent_share=0.0)
    res = await run_on_sims(
        workload, 1, concurrency=2, max_seconds=30, request_timeout_s=10, stream=False
    )
    assert res.ok == res.sent == workload.planned_requests
    assert all(r.answer and r.prompt_tokens and r.ttft_s is None for r in res.records)
