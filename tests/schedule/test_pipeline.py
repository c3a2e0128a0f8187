"""The pipeline's own rules: filters relax last-first, cost is the sum of weighted terms,
the Decision carries every term and which filter removed whom."""

from __future__ import annotations

from typing import Any

import pytest

from router.schedule import (
    Candidate,
    Decision,
    HashRing,
    Pipeline,
    PluginSpec,
    ProfileSpec,
    ScheduleError,
    build,
    registry,
)
from router.schedule.types import Cycle, Hook, Scorer
from tests.schedule.common import req


def _profile(*filters: str, weights: dict[str, float] | None = None) -> ProfileSpec:
    weights = weights or {"uncached_prefill": 1.0, "inflight": 8.0}
    return ProfileSpec(
        tuple(PluginSpec(f) for f in filters),
        tuple(PluginSpec(n, weight=w) for n, w in weights.items()),
        PluginSpec("ring_min_cost"),
    )


def test_terms_and_cost_are_visible_per_candidate():
    p = build(_profile(), HashRing(["a", "b"]))
    d = p.choose(req(160), [Candidate("a", matched_blocks=5, inflight=2), Candidate("b")])
    assert d.terms == {
        "a": {"uncached_prefill": 160 - 5 * 16, "inflight": 16.0},
        "b": {"uncached_prefill": 160.0, "inflight": 0.0},
    }
    assert [s.cost for s in d.scores] == [96.0, 160.0]
    assert d.replica == "a" and d.reason == "prefix"


@pytest.mark.parametrize("policy", ["ring_spill", "ttft", "sticky_prefix"])
def test_an_offloaded_prefix_ranks_below_the_gpu_and_above_a_cold_replica(policy: str):
    """Three replicas hold 8 blocks of a prompt: on the GPU, 6 of them only in CPU memory
    (weight 0.5: worth 5), none. Each policy ranks them in that order, and the prediction
    counts every held block (vLLM reports loaded blocks in cached_tokens)."""
    r = req(160)
    ring = HashRing(["gpu", "cpu", "cold"])
    pipeline = registry.build_named(policy, ring, {})

    def fleet(*urls: str) -> list[Candidate]:
        every = {
            "gpu": Candidate("gpu", matched_blocks=8),
            "cpu": Candidate("cpu", matched_blocks=8, offloaded_blocks=6, offload_weight=0.5),
            "cold": Candidate("cold"),
        }
        return [every[u] for u in urls]

    d = pipeline.choose(r, fleet("gpu", "cpu", "cold"))
    assert d.replica == "gpu" and d.matched_blocks == 8 and d.offloaded_blocks == 0
    scored = {s.url: s for s in d.scores}
    assert (scored["cpu"].weighted_blocks, scored["cpu"].offloaded_blocks) == (5.0, 6)
    if "uncached_prefill" in d.terms["cpu"]:
        assert d.terms["cpu"]["uncached_prefill"] == 160 - 5 * 16
    d = pipeline.choose(r, fleet("cold", "cpu"))
    assert d.replica == "cpu" and d.reason == "prefix"
    assert (d.matched_blocks, d.offloaded_blocks) == (8, 6)


def test_filters_record_who_removed_whom_and_relax_last_first():
    p = build(_profile("load_bound", "recent_share"), HashRing(["a", "b", "c"]))
    cands = [Candidate("a", matched_blocks=9, inflight=30), Candidate("b"), Candidate("c")]
    d = p.choose(req(160), cands)
    assert d.filtered == {"a": "load_bound"} and d.replica != "a"
    # recent_share removes everyone: it is relaxed, load_bound still holds
    p.recent.clock = lambda: 0.0
    for u in ("b", "c"):
        for _ in range(40):
            p.recent.add(u)
    loads = [Candidate("a", inflight=30), Candidate("b", inflight=0), Candidate("c")]
    d = p.choose(req(160), loads)
    assert d.filtered == {"a": "load_bound"}


def test_when_every_bound_would_remove_everyone_nobody_is_removed():
    p = build(_profile("load_bound"), HashRing(["a"]))
    assert p.choose(req(160), [Candidate("a", inflight=50)]).filtered == {}


def test_weight_zero_scorers_are_left_out_and_uses_index_follows_the_plugins():
    p = build(_profile(weights={"inflight": 1.0, "kv_pressure": 0.0}), HashRing(["a"]))
    assert p.describe()["scorers"] == {"inflight": 1.0}
    assert p.uses_index  # ring_min_cost reads matches
    baseline = build(ProfileSpec((), (), PluginSpec("round_robin")), HashRing(["a"]))
    assert not baseline.uses_index


class _Zero(Scorer):
    """A scorer with the defaults of every declaration."""

    name = "zero"

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return 0.0


class _Undeclared:
    """A scorer written against the old probing: no declarations at all."""

    name = "undeclared"
    uses_index = True

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return 0.0


class _HookNotDeclared(_Zero):
    name = "hook_not_declared"

    def first_byte(self, decision: Decision, now: float) -> None:
        pass


class _HookNotDefined(_Zero):
    name = "hook_not_defined"
    hooks = frozenset({Hook.DONE})


class _Hooked(_Zero):
    name = "hooked"
    hooks = frozenset({Hook.PLACED, Hook.DONE})

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int | None]] = []

    def placed(self, decision: Decision, now: float) -> None:
        self.seen.append(("placed", decision.replica, None))

    def done(self, decision: Decision, status: int | None, now: float) -> None:
        self.seen.append(("done", decision.replica, status))


def _pipeline(scorer: Any) -> Pipeline:
    picker = registry.plugin("picker", PluginSpec("ring_min_cost"))
    return Pipeline("p", HashRing(["a", "b"]), [], [(scorer, 1.0)], picker)


def test_plugin_declarations_are_checked_when_the_profile_is_built():
    _pipeline(_Zero())  # the defaults of every declaration, inherited
    with pytest.raises(ScheduleError, match="undeclared does not declare uses_recent, hooks"):
        _pipeline(_Undeclared())
    with pytest.raises(ScheduleError, match="defines first_byte but does not declare it"):
        _pipeline(_HookNotDeclared())
    with pytest.raises(ScheduleError, match="declares done but does not define it"):
        _pipeline(_HookNotDefined())


def test_the_pipeline_calls_exactly_the_hooks_a_plugin_declares():
    hooked = _Hooked()
    p = _pipeline(hooked)
    d = p.choose(req(160), [Candidate("a"), Candidate("b")])
    p.placed(d)
    p.first_byte(d)  # not declared: not called
    p.done(d, 200)
    assert hooked.seen == [("placed", d.replica, None), ("done", d.replica, 200)]
