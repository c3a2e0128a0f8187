"""The load-test harness end to end, over loopback sockets, against simulated replicas."""

from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import socket

import aiohttp
import pytest
from aiohttp import web

from loadtest import workloads as wl
from loadtest.cli import main as cli_main
from loadtest.metrics_scrape import scrape_all
from loadtest.replica import SimConfig, run_replicas
from loadtest.report import failure_line, write_report
from loadtest.runner import (
    REPLICA_HEADER,
    ClientTarget,
    GatewayTarget,
    client_cpu_warning,
    run_workload,
)
from router import __version__
from tests.helpers import serve

# fast, but not instant: requests overlap and TTFT is not zero
FAST = {
    "prefill_tokens_per_s": 5_000_000.0,
    "decode_tokens_per_s": 50_000.0,
    "request_overhead_s": 0.0002,
}


def small_multi_tenant(seed: int = 0) -> wl.Workload:
    return wl.multi_tenant(
        seed=seed,
        tenants=2,
        conversations=6,
        rate=40.0,
        turns=(2, 3),
        think_time_s=0.01,
        system_words=200,
        max_tokens=8,
    )


async def test_round_robin_run_writes_a_report_from_the_replicas_counters(tmp_path):
    async with run_replicas(3, SimConfig(**FAST)) as reps:
        urls = [r.url for r in reps]
        target = ClientTarget(urls, "round_robin")
        workload = small_multi_tenant()
        res = await run_workload(
            target, workload, concurrency=4, max_seconds=20, request_timeout_s=10, progress=False
        )
        after = await scrape_all(urls)
    out = write_report([res], tmp_path / "rep")
    for name in (
        "summary.md",
        "summary.json",
        "requests.jsonl",
        "ttft_cdf.png",
        "hit_rate_per_replica.png",
        "timeline.png",
        "ttft_by_context.png",
        "hit_rate_over_time.png",
    ):
        assert (out / name).stat().st_size > 0, name
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == len(res.records) == res.sent == workload.planned_requests
    assert res.lost == 0 and res.ok == res.sent and not res.errors_by_status
    # hit rates come from the replicas' own counters (fresh replicas: deltas == totals)
    assert res.fleet_hit_rate == pytest.approx(
        sum(m.hits for m in after) / sum(m.queries for m in after)
    )
    assert 0.0 < res.fleet_hit_rate <= 1.0
    for row in res.replica_rows():
        assert row.metrics_ok and 0.0 <= row.hit_rate <= 1.0
    assert (
        sorted(row.requests for row in res.replica_rows())[-1]
        - sorted(row.requests for row in res.replica_rows())[0]
        <= 1
    )
    assert 0.0 < res.ideal_hit_rate <= 1.0
    assert res.fleet_hit_rate <= res.ideal_hit_rate + 0.02
    # the harness tokenizes exactly as the replica does; TTFT is measured on every stream
    assert all(r.harness_prompt_tokens == r.prompt_tokens for r in res.records)
    assert all(r.ttft_s is not None and 0 <= r.ttft_s <= r.latency_s for r in res.records)
    assert not [w for w in res.warnings if "tokenization" in w]
    rec = json.loads(lines[0])
    assert {"run", "group", "replica", "ttft_s", "cached_tokens", "status"} <= rec.keys()
    summary = (out / "summary.md").read_text()
    assert "| round_robin |" in summary and "fleet hit" in summary
    assert res.stop_reason == "workload"
    assert f"every one of its {workload.planned_requests} requests was sent" in summary
    # Replica sets: every group's requests by replica (round robin spreads each group).
    assert "Replica sets: 2 prefix groups" in summary
    # the load generator's own CPU share (with the in-process replicas) is reported
    assert res.client_cpu_s > 0 and f"{res.client_cpu_s:.1f} s of CPU" in summary
    assert json.loads((out / "summary.json").read_text())["runs"][0]["client_cpu_s"] > 0


def test_a_busy_load_generator_is_warned_about() -> None:
    assert client_cpu_warning(2.0, 10.0) is None
    warning = client_cpu_warning(8.0, 10.0)
    assert warning is not None and "80% of a core" in warning and "bottleneck" in warning


async def test_preamble_position_orders_the_fleet_hit_rate():
    rates = {}
    for pos in wl.PREAMBLE_POSITIONS:
        async with run_replicas(2, SimConfig(**FAST)) as reps:
            w = wl.preamble(pos, conversations=3, turns=4, system_words=300, tools=3, max_tokens=8)
            res = await run_workload(
                ClientTarget([r.url for r in reps], "round_robin"),
                w,
                concurrency=3,
                max_seconds=20,
                progress=False,
                compute_ideal=False,
            )
        assert res.lost == 0 and res.ok == 12
        rates[pos] = res.fleet_hit_rate
    assert rates["first"] < 0.05
    assert rates["first"] < rates["after_system"] < rates["last"]


async def test_trace_replay_respects_max_requests_and_random_policy_is_seeded():
    async with run_replicas(2, SimConfig(**FAST)) as reps:
        urls = [r.url for r in reps]
        w = wl.trace(time_scale=200.0, max_output_tokens=4, max_input_tokens=8000)
        picks = []
        for _ in range(2):
            res = await run_workload(
                ClientTarget(urls, "random", seed=3),
                w,
                concurrency=4,
                max_requests=10,
                max_seconds=20,
                progress=False,
            )
            assert res.sent == res.ok == 10 and res.lost == 0
            assert all(r.endpoint == "completions" for r in res.records)
            assert all(r.harness_prompt_tokens == r.prompt_tokens for r in res.records)
            picks.append([urls.index(r.replica) for r in res.records])
        assert picks[0] == picks[1]
        assert 0.0 <= res.fleet_hit_rate <= 1.0 and res.ideal_hit_rate is not None


async def test_max_seconds_bounds_the_run():
    async with run_replicas(1, SimConfig(**FAST)) as reps:
        w = wl.multi_tenant(conversations=50, rate=5.0, system_words=50, think_time_s=2.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await run_workload(
            ClientTarget([reps[0].url]), w, max_seconds=0.6, progress=False, compute_ideal=False
        )
        assert loop.time() - t0 < 3.0
        assert 0 < res.sent < w.planned_requests and res.lost == 0
        assert res.stop_reason == "max_seconds"
        assert res.stop_description().startswith("reached the 0.6 s limit; ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unanswered_requests_are_counted_as_lost():
    dead = f"http://127.0.0.1:{_free_port()}"
    async with run_replicas(1, SimConfig(**FAST)) as reps:
        w = wl.prefix_repetition(
            num_prefixes=2, suffixes_per_prefix=3, prefix_len=32, suffix_len=8, output_len=2
        )
        res = await run_workload(
            ClientTarget([reps[0].url, dead]),
            w,
            progress=False,
            request_timeout_s=5,
            max_seconds=10,
        )
    assert res.sent == 6 and res.lost == 3 and res.ok == 3
    assert sum(res.errors_by_status.values()) == 3
    assert any("unavailable" in x for x in res.warnings)
    assert failure_line([res]).startswith("error: 3 of 6 requests failed: 3 x lost (")


async def test_gateway_target_takes_the_replica_from_the_response_header():
    async with run_replicas(2, SimConfig(**FAST)) as reps:
        urls = [r.url for r in reps]
        turn = itertools.cycle(urls)

        async def proxy(request: web.Request) -> web.StreamResponse:
            upstream = next(turn)
            body = await request.read()
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    upstream + request.path, data=body, headers={"content-type": "application/json"}
                ) as up,
            ):
                resp = web.StreamResponse(
                    status=up.status,
                    headers={
                        "content-type": up.headers.get("content-type", "application/json"),
                        REPLICA_HEADER: upstream,
                        "x-prefix-router-cached-blocks": "3",
                    },
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", proxy)
        runner, proxy_url = await serve(app, access_log=None)
        try:
            res = await run_workload(
                GatewayTarget(proxy_url, urls),
                small_multi_tenant(1),
                concurrency=2,
                progress=False,
                max_seconds=20,
            )
        finally:
            await runner.cleanup()
    assert res.lost == 0 and res.ok == res.sent > 0
    assert {r.replica for r in res.records} == set(urls)
    assert all(r.predicted_cached_blocks == 3 for r in res.records)
    assert sum(row.requests for row in res.replica_rows()) == res.sent


def test_cli_run_and_compare_with_simulated_replicas(tmp_path):
    common = [
        "--workload",
        "prefix_repetition",
        "--num-prefixes",
        "2",
        "--suffixes-per-prefix",
        "3",
        "--prefix-len",
        "64",
        "--suffix-len",
        "16",
        "--output-len",
        "4",
        "--quiet",
        "--sim",
        "2",
        "--sim-instant",
    ]
    assert cli_main(["run", *common, "--out", str(tmp_path / "run")]) == 0
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "flatters hit rates" in summary and "| round_robin |" in summary
    # The command that made it and the version that ran it.
    assert f"\n{shlex.join(['prefix-router', 'loadtest', 'run', *common])} --out " in summary
    assert f"by prefix-router {__version__}" in summary and "Python 3." in summary
    assert (
        cli_main(
            [
                "compare",
                *common,
                "--policies",
                "client:round_robin,client:random",
                "--out",
                str(tmp_path / "cmp"),
            ]
        )
        == 0
    )
    runs = json.loads((tmp_path / "cmp" / "summary.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["round_robin (client)", "random (client)"]
    assert all(r["lost"] == 0 and r["sent"] == 6 for r in runs)
    with pytest.raises(SystemExit):
        cli_main(["run", "--workload", "preamble", "--quiet"])  # no target given


def test_cli_run_fails_when_requests_fail(tmp_path, capsys):
    """A model-name mismatch: every request is a 404. The run exits 1 and says how many
    failed and why, in one line before the table (it used to exit 0: nothing was lost)."""
    args = [
        "run",
        "--workload",
        "prefix_repetition",
        "--num-prefixes",
        "2",
        "--suffixes-per-prefix",
        "3",
        "--prefix-len",
        "16",
        "--suffix-len",
        "8",
        "--output-len",
        "2",
        "--sim",
        "1",
        "--sim-instant",
        "--model",
        "no-such-model",
        "--out",
        str(tmp_path / "run"),
    ]
    assert cli_main(args) == 1
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert (
        line
        == "error: 6 of 6 requests failed: 6 x HTTP 404: The model `no-such-model` does not exist."
    )
    assert "| round_robin |" in out  # the table still follows


async def test_report_shows_a_gateways_spills_and_replica_sets(tmp_path, fleet, gateway):
    """Through a real gateway the report says where each prefix group went and why: its
    replica set, the gateway's decisions by reason and its spills."""
    replicas = await fleet(3, **FAST)
    urls = [r.url for r in replicas]
    gw = await gateway(urls, policy="ring_spill")
    res = await run_workload(
        GatewayTarget(gw.url, urls, policy="ring_spill"),
        small_multi_tenant(2),
        concurrency=4,
        progress=False,
        max_seconds=30,
        compute_ideal=False,
    )
    assert res.lost == 0 and res.ok == res.sent > 0
    decisions = {k: v for k, v in res.gateway_counters.items() if k.startswith("decisions:")}
    assert sum(decisions.values()) == res.sent  # one decision per request of this run
    sets = res.replica_sets()
    assert sum(sum(c.values()) for c in sets.values()) == res.sent
    summary = (write_report([res], tmp_path / "rep", plots=False) / "summary.md").read_text()
    assert f"Replica sets: {len(sets)} prefix groups" in summary
    assert "Gateway decisions by reason: " in summary and "Spills (placed away" in summary
    assert "| replica | requests | groups | hottest group's share |" in summary
    data = json.loads((tmp_path / "rep" / "summary.json").read_text())["runs"][0]
    assert sum(data["replica_set_sizes"].values()) == len(sets)


def test_the_report_says_what_reuse_the_gateways_routing_left_unused():
    from loadtest.report import reuse_line

    assert reuse_line({}) is None  # a gateway that does not count reuse, or a client policy
    blind = {"reuse:prompt": 100.0, "reuse:available": 0.0, "reuse:captured": 0.0}
    assert reuse_line(blind) is None  # a policy that never reads the index
    counters = {
        "reuse:prompt": 10_000.0,
        "reuse:available": 8_000.0,
        "reuse:captured": 7_000.0,
        "reuse:delivered": 6_900.0,
    }
    line = reuse_line(counters)
    assert line is not None
    assert "available in the fleet 8,000 (80.0%)" in line
    assert "captured by routing 7,000 (70.0%)" in line
    assert "delivered by the replicas 6,900" in line
    assert line.endswith("requests went: 1,000 (10.0%).")
