"""The pressure workload and the simulated fleet's vLLM rules (block pool, hits, eviction)."""

from __future__ import annotations

from collections import Counter

from loadtest.pressure import PressureParams, conversations, tenant_weights
from loadtest.pressure_sim import FleetParams, Pool, Req, Sim
from router.core.blocks import block_hashes


def _req(ids: list[int], out: int = 0) -> Req:
    return Req(0, 0, ids, [7] * out, block_hashes(ids, 16))


def test_workload_is_seeded_and_the_hottest_tenant_sends_about_a_third():
    p = PressureParams(conversations=600)
    a, b = conversations(p), conversations(p)
    assert [c.turns[-1].prompt for c in a] == [c.turns[-1].prompt for c in b]
    assert abs(tenant_weights(32, 1.25)[0] - 1 / 3) < 0.02
    share = Counter(c.tenant for c in a)[0] / len(a)
    assert 0.28 < share < 0.40
    c = a[0]
    assert 2300 <= len(c.turns[0].prompt) <= 2800
    later = c.turns[1].prompt  # history: the previous prompt and its answer, then a question
    assert later[: len(c.turns[0].prompt) + len(c.turns[0].output)] == (
        c.turns[0].prompt + c.turns[0].output
    )


def test_hit_is_the_leading_run_capped_below_the_last_token():
    pool = Pool(64)
    first = _req(list(range(64)))  # exactly 4 full blocks
    assert pool.admit(first, 16) and first.hit_blocks == 0
    pool.cache(first, first.hashes)
    pool.release(first)
    again = _req(list(range(64)))
    assert pool.admit(again, 16) and again.hit_blocks == 3  # the last token is computed
    pool.release(again)
    other = _req([999] + list(range(1, 64)))  # block 0 differs: nothing after it counts
    assert pool.admit(other, 16) and other.hit_blocks == 0


def test_eviction_takes_the_least_recently_freed_and_pinned_blocks_stay():
    pool = Pool(8)
    a, b = _req([1] * 64), _req([2] * 64)
    for r in (a, b):
        assert pool.admit(r, 16)
        pool.cache(r, r.hashes)
        pool.release(r)  # 4 cached blocks each, a's older
    c = _req([3] * 64)
    assert pool.admit(c, 16)  # needs 4: a's are evicted, b's stay
    assert pool.evictions == 4
    assert pool.hit(b.hashes, 4) == 4 and pool.hit(a.hashes, 4) == 0
    d = _req([4] * 80)  # 5 blocks; only b's 4 are free
    assert not pool.admit(d, 16)


def test_sticky_keeps_each_tenant_on_one_replica_and_round_robin_spreads():
    convs = conversations(PressureParams(conversations=40, tenants=4))
    fp = FleetParams(replicas=4, prefill_tps=20_000.0)
    sticky = Sim(convs, "sticky_prefix", fp).run()
    homes: dict[int, set[str]] = {}
    for r in sticky.reqs:
        homes.setdefault(convs[r.conv].tenant, set()).add(r.replica)
    assert all(len(h) == 1 for h in homes.values())
    assert sticky.hits / sticky.queries > 0.95 * sticky.ideal_hits / sticky.ideal_queries
    rr = Sim(convs, "round_robin", fp).run()
    assert max(rr.per_replica.values()) - min(rr.per_replica.values()) <= 1
    assert rr.hits < sticky.hits


def test_pressure_is_a_runner_workload_with_token_id_prompts():
    from loadtest.workloads import WORKLOADS, build, collect_specs

    assert "pressure" in WORKLOADS
    w = build("pressure", seed=1, conversations=3, tenants=4)
    specs = collect_specs(w)
    assert len(specs) == 12 and all(s.endpoint == "completions" for s in specs)
    first = conversations(PressureParams(seed=1, conversations=3, tenants=4))[0]
    assert specs[0].prompt_token_ids() == list(first.turns[0].prompt)


def test_bench_prints_one_table_with_the_sticky_ratios(capsys):
    from loadtest.bench_pressure import main

    assert main(["--seeds", "1", "--conversations", "24", "--tenants", "4"]) == 0
    out = capsys.readouterr().out
    for name in ("ttft", "sticky_prefix", "round_robin", "ring_spill", "p99/sticky"):
        assert name in out
    assert "unknown policy" not in out
