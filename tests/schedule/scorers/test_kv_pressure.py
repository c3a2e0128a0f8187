"""kv_pressure: off (weight 0) in ttft by default; weighted, it steers away from a full cache."""

from __future__ import annotations

from router.schedule import Candidate, HashRing, build_named
from tests.schedule.common import req

URLS = ["http://a:8000", "http://b:8000", "http://c:8000"]


def _fleet(full: str) -> list[Candidate]:
    # Every replica holds the prompt's first 40 blocks; the full one holds 4 more.
    return [
        Candidate(u, matched_blocks=44 if u == full else 40, kv_usage=0.97 if u == full else 0.2)
        for u in URLS
    ]


def test_weighted_kv_pressure_moves_the_decision_off_a_full_cache():
    r = req(ids=[3] * 640 + list(range(200)))
    full = URLS[1]
    default = build_named("ttft", HashRing(URLS)).choose(r, _fleet(full))
    assert default.replica == full and default.reason == "prefix"  # 64 tokens less to prefill
    assert "kv_pressure" not in default.terms[full]  # weight 0: not even scored

    # A full cache is worth 1000 prompt tokens of prefill: 0.97 x 1000 outweighs 64.
    steered = build_named("ttft", HashRing(URLS), {"kv_pressure": 1000}).choose(r, _fleet(full))
    assert steered.replica != full and steered.reason == "spill"
    assert steered.terms[full]["kv_pressure"] == 970.0
    assert steered.terms[steered.replica]["kv_pressure"] == 200.0


def test_a_light_weight_does_not_override_a_longer_prefix():
    r = req(ids=[3] * 640 + list(range(200)))
    d = build_named("ttft", HashRing(URLS), {"kv_pressure": 50}).choose(r, _fleet(URLS[2]))
    assert d.replica == URLS[2]  # 0.77 x 50 < 64 tokens saved
