"""What a decision says about a spill (cause, the copy it makes, the prefix's replica set),
what the metrics count from it, and the observed time to first byte ring_spill reads."""

from __future__ import annotations

from prometheus_client import generate_latest

from router.schedule import Candidate, HashRing, build_named
from router.schedule.observed import ObservedTTFT
from router.telemetry.metrics import Metrics
from tests.schedule.common import req

URLS = ["a", "b", "c", "d"]


def _ttft_spill():
    """ttft with the only full holder over the load bound: a spill the filter caused."""
    r = req(640, first=3)
    cands = [
        Candidate("a", matched_blocks=39, inflight=30),
        Candidate("b", matched_blocks=10),
        Candidate("c"),
        Candidate("d"),
    ]
    return build_named("ttft", HashRing(URLS)).choose(r, cands)


def test_a_filtered_holder_names_the_filter_and_the_copy_is_the_difference():
    d = _ttft_spill()
    assert d.reason == "spill" and d.replica == "b"
    assert (d.cause, d.copied_blocks, d.holders) == ("load_bound", 29, 2)


def test_no_spill_no_cause():
    r = req(640, first=3)
    d = build_named("ttft", HashRing(URLS)).choose(r, [Candidate("a", matched_blocks=39)])
    assert (d.reason, d.cause, d.copied_blocks, d.holders) == ("prefix", None, 0, 1)


def test_metrics_count_spills_by_cause_and_their_copied_blocks():
    m = Metrics()
    m.placed(_ttft_spill())
    text = generate_latest(m.registry).decode()
    assert 'prefix_router_spills_total{cause="load_bound",policy="ttft"} 1.0' in text
    assert 'prefix_router_spill_evicted_blocks_estimated_total{policy="ttft"} 29.0' in text
    assert 'prefix_router_prefix_replicas_bucket{le="2.0",policy="ttft"} 1.0' in text
    assert 'prefix_router_prefix_replicas_bucket{le="1.0",policy="ttft"} 0.0' in text


def test_observed_ttft_moves_by_alpha_and_decays_between_observations():
    now = [0.0]
    t = ObservedTTFT(alpha=0.5, half_life_s=10.0, clock=lambda: now[0])
    assert t.get() == 0.0
    t.observe(4.0)  # the first observation is the value
    assert t.get() == 4.0
    t.observe(2.0)
    assert t.get() == 3.0
    now[0] = 10.0  # one half-life with nothing observed
    assert abs(t.get() - 1.5) < 1e-9
