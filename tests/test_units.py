"""Unit tests of the pure pieces: block hashing, the memory index, the ring, the policies,
the config loader."""

from __future__ import annotations

import argparse
import collections
import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import ConfigError, add_arguments, dump_yaml, load_config
from router.core.blocks import ChainCache, block_hashes, cacheable_blocks
from router.index import MemoryIndex
from router.schedule import Candidate, HashRing, Rings, build_named
from tests.schedule.common import req as _req

# -- blocks ---------------------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_chains_share_prefixes():
    a = list(range(100))
    b = list(range(40)) + [9999] + list(range(41, 100))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 6  # 100 // 16: the partial tail is never hashed
    assert ha[:2] == hb[:2]  # identical up to token 40: blocks 0 and 1 shared
    assert all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))  # block 2 differs, so all after
    assert block_hashes(a, 16, max_blocks=3) == ha[:3]
    assert block_hashes(a[:15], 16) == []


def test_salt_and_adapter_rekey_every_block():
    ids = list(range(64))
    plain = block_hashes(ids, 16)
    salted = block_hashes(ids, 16, cache_salt="s1")
    assert not set(plain) & set(salted)
    assert not set(salted) & set(block_hashes(ids, 16, cache_salt="s2"))
    assert not set(plain) & set(block_hashes(ids, 16, lora="adapter"))
    assert salted == block_hashes(ids, 16, cache_salt="s1")


@given(
    shared=st.integers(0, 3),
    tail=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 2, 16]),
    salt=st.sampled_from([None, "a", "b"]),
    lora=st.sampled_from([None, "adapter"]),
    max_blocks=st.sampled_from([None, 0, 3, 40]),
    packed=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_chain_cache_equals_block_hashes(shared, tail, block_size, salt, lora, max_blocks, packed):
    """Memoised runs of blocks never change a hash: same prefixes under another salt, adapter,
    block size or cut-off, in a cache small enough to evict."""
    ids = PREFIXES[shared] + tail
    got = CHAIN_CACHE.block_hashes(
        array("I", ids) if packed else ids,
        block_size,
        cache_salt=salt,
        lora=lora,
        max_blocks=max_blocks,
    )
    assert got == block_hashes(ids, block_size, cache_salt=salt, lora=lora, max_blocks=max_blocks)


def test_chain_cache_hits_on_a_shared_prefix():
    cache = ChainCache()
    ids = list(range(1000))
    first = cache.block_hashes(ids, 16)
    held = len(cache._groups)
    assert held == 1000 // 16 // ChainCache.GROUP
    assert cache.block_hashes(ids + [7] * 50, 16)[: len(first)] == first
    assert cache.block_hashes(ids, 16, cache_salt="s") != first  # a salt never hits
    assert len(cache._groups) == 2 * held + 1  # the longer prompt added one, the salt its own


_rng = random.Random(5)
PREFIXES = [[], *([_rng.randrange(2**32) for _ in range(n)] for n in (64, 600, 1100))]
CHAIN_CACHE = ChainCache(max_groups=3)


def test_cacheable_blocks_caps_at_num_tokens_minus_one():
    assert cacheable_blocks(32, 16) == 1  # the last token is always recomputed
    assert cacheable_blocks(33, 16) == 2
    assert cacheable_blocks(1, 16) == 0


# -- memory index -----------------------------------------------------------------------------


async def test_memory_index_leading_match_and_lru():
    index = MemoryIndex(default_capacity=10)
    a = block_hashes(list(range(160)), 16)  # 10 blocks
    await index.record("r1", a[:6])
    assert await index.match(a, ["r1", "r2"]) == {"r1": 6, "r2": 0}
    await index.forget("r1", a[2:])
    assert (await index.match(a, ["r1"]))["r1"] == 2  # stops at the first miss
    b = block_hashes([7] * 160, 16)
    await index.record("r1", b[:8])  # over capacity: the oldest blocks go, tails first
    assert index.size("r1") == 10
    assert (await index.match(b, ["r1"]))["r1"] == 8
    assert (await index.match(a, ["r1"]))["r1"] == 2  # a's head survived its tail
    await index.set_capacity("r1", 4)
    assert index.size("r1") == 4
    await index.drop_replica("r1")
    assert index.size("r1") == 0


# -- ring -------------------------------------------------------------------------------------


def test_ring_is_deterministic_and_moves_little_when_growing():
    members = [f"http://r{i}" for i in range(4)]
    r1, r2 = HashRing(members), HashRing(reversed(members))
    keys = [random.Random(i).getrandbits(64) for i in range(2000)]
    assert [next(r1.walk(k)) for k in keys] == [next(r2.walk(k)) for k in keys]
    grown = HashRing(members + ["http://r4"])
    moved = sum(next(r1.walk(k)) != next(grown.walk(k)) for k in keys)
    assert moved < 2000 * 0.3  # about 1/5 should move; a modulo hash would move 4/5
    owners = collections.Counter(next(r1.walk(k)) for k in keys)
    assert min(owners.values()) > 2000 / 4 * 0.6


def test_each_model_has_its_own_ring_over_its_members():
    """Model A's ring holds A's replicas among the members, whatever else the fleet serves
    or in which order the groups came; a model no replica reported gets the fleet's ring."""
    a = [f"http://a{i}" for i in range(3)]
    b = [f"http://b{i}" for i in range(2)]
    rings, other = Rings(), Rings()
    rings.set_members(a + b[:1], {"A": a, "B": b})  # b1 is not a member (down everywhere)
    other.set_members(reversed(a + b[:1]), {"B": b, "A": a})
    assert rings.of("A").members == tuple(a) and rings.of("B").members == (b[0],)
    assert rings.models() == other.models()
    keys = [random.Random(i).getrandbits(64) for i in range(200)]
    alone = HashRing(a)
    assert [list(rings.of("A").walk(k)) for k in keys] == [list(alone.walk(k)) for k in keys]
    assert rings.of("C") is rings.of(None) and set(rings.of("C").members) == set(a + b[:1])
    rings.set_members(a, {"A": a})  # B's replicas left: its ring is gone
    assert "B" not in rings.models() and rings.members == tuple(a)


def test_ring_bounded_load_walks_past_a_full_member():
    ring = HashRing([f"http://r{i}" for i in range(4)])
    key = 12345
    home = next(ring.walk(key))
    loads = collections.defaultdict(int, {home: 10})
    pick = ring.pick(key, loads.__getitem__, ring.members, 1.25)
    assert pick != home
    assert ring.pick(key, collections.defaultdict(int).__getitem__, ring.members, 1.25) == home


# -- policies ---------------------------------------------------------------------------------


def test_ttft_prefers_the_holder_until_its_queue_outweighs_the_prefill():
    ring = HashRing(["a", "b", "c"])
    policy = build_named("ttft", ring)
    req = _req(1600)
    warm = [Candidate("a", matched_blocks=90), Candidate("b"), Candidate("c")]
    d = policy.choose(req, warm)
    assert (d.replica, d.reason, d.matched_blocks) == ("a", "prefix", 90)
    busy = [
        Candidate("a", matched_blocks=90, inflight=3, pending_prefill_tokens=5000),
        Candidate("b", inflight=3),
        Candidate("c", inflight=3),
    ]
    d = policy.choose(req, busy)
    assert d.replica != "a" and d.reason == "spill"


def test_ttft_load_bound_stops_piling_onto_one_replica():
    ring = HashRing(["a", "b", "c", "d"])
    policy = build_named("ttft", ring, knobs={"load_bound": 1.25})
    req = _req(1600)
    cands = [
        Candidate("a", matched_blocks=99, inflight=12),
        Candidate("b", inflight=1),
        Candidate("c", inflight=1),
        Candidate("d", inflight=1),
    ]
    d = policy.choose(req, cands)
    assert d.replica != "a"
    assert next(s for s in d.scores if s.url == "a").filtered == "over load bound"


def test_cold_prefixes_follow_the_ring_and_spread():
    ring = HashRing(["a", "b", "c", "d"])
    policy = build_named("ttft", ring)
    picks = collections.Counter()
    for i in range(400):
        d = policy.choose(_req(64, first=i), [Candidate(u) for u in "abcd"])
        assert d.reason == "ring" and d.replica == d.ring_choice
        picks[d.replica] += 1
    assert len(picks) == 4 and max(picks.values()) < 200


def test_ties_between_equal_holders_do_not_all_break_one_way():
    ring = HashRing(["a", "b"])
    policy = build_named("ttft", ring)
    picks = collections.Counter(
        policy.choose(
            _req(64, first=i), [Candidate("a", matched_blocks=3), Candidate("b", matched_blocks=3)]
        ).replica
        for i in range(200)
    )
    assert set(picks) == {"a", "b"}


@pytest.mark.parametrize("name", ["round_robin", "random", "least_loaded", "consistent_hash"])
def test_baselines_spread_and_stay_in_candidates(name):
    policy = build_named(name, HashRing(["a", "b", "c"]))
    picks = collections.Counter(
        policy.choose(_req(64, first=i), [Candidate(u) for u in "abc"]).replica for i in range(300)
    )
    assert set(picks) == {"a", "b", "c"}


# -- config -----------------------------------------------------------------------------------


def test_config_precedence_file_env_flags(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("port: 9000\nblock_size: 32\nreplicas: [http://a:1]\npolicy: round_robin\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(cfg), "--port", "9100"])
    config = load_config(
        args,
        env={
            "PREFIX_ROUTER_PORT": "9050",
            "PREFIX_ROUTER_BLOCK_SIZE": "64",
            "PREFIX_ROUTER_REPLICAS": "http://b:1,http://c:1",
        },
    )
    assert config.server.port == 9100  # flag beats env beats file
    assert config.routing.block_size == 64
    assert config.discovery.replicas == ["http://b:1", "http://c:1"]
    assert config.routing.policy == "round_robin"


@pytest.mark.parametrize(
    "text,message",
    [
        ("bogus_key: 1\n", "unknown key"),
        ("port: nope\n", "port must be int"),
        ("policy: fastest\n", "unknown policy"),
        ("replicas: [10.0.0.1:8000]\n", "http://"),
        ("- just\n- a list\n", "mapping"),
    ],
)
def test_config_errors_are_readable(tmp_path, text, message):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(argparse.Namespace(config=str(cfg)), env={})


def test_printed_config_masks_secrets():
    config = load_config(None, env={"PREFIX_ROUTER_SALT_SECRET": "super-secret-value-123"})
    text = dump_yaml(config)
    assert "super-secret-value-123" not in text and "salt_secret: '***'" in text


def test_conversations_behind_one_shared_system_prompt_spread():
    # Every replica holds the shared 32-block system prompt; what follows differs per
    # conversation. Ties must break by the first unshared block, not all toward one replica.
    ring = HashRing(["a", "b", "c", "d"])
    policy = build_named("ttft", ring)
    picks = collections.Counter()
    for i in range(200):
        ids = [7] * 512 + [i] * 256
        req = _req(ids=ids)
        d = policy.choose(req, [Candidate(u, matched_blocks=32) for u in "abcd"])
        assert d.matched_blocks == 32 and d.reason == "prefix"
        picks[d.replica] += 1
    assert len(picks) == 4 and max(picks.values()) < 100, picks


def test_a_popular_prefix_at_light_load_spreads_by_recent_share():
    # One tenant sends everything, one request at a time: nothing ever queues, so only the
    # share bound can keep one replica from taking the whole fleet's traffic.
    ring = HashRing(["a", "b", "c", "d"])
    policy = build_named("ttft", ring)
    clock = [0.0]
    policy.recent.clock = lambda: clock[0]
    held: set[str] = set()
    picks = collections.Counter()
    for i in range(400):
        clock[0] += 0.05  # 20 requests/s
        ids = [5] * 800 + [i] * 32
        req = _req(ids=ids)
        d = policy.choose(
            req, [Candidate(u, matched_blocks=50 if u in held else 0) for u in "abcd"]
        )
        policy.placed(d)
        held.add(d.replica)
        picks[d.replica] += 1
    assert max(picks.values()) / (400 / 4) <= 1.3, picks
    # ... while the first few requests stuck to one replica (below the sustained threshold).
    fresh = build_named("ttft", HashRing(["a", "b", "c", "d"]))
    first = fresh.choose(_req(800), [Candidate(u) for u in "abcd"]).replica
    for _ in range(8):
        d = fresh.choose(
            _req(800), [Candidate(u, matched_blocks=49 if u == first else 0) for u in "abcd"]
        )
        fresh.placed(d)
        assert d.replica == first


def test_usage_of_takes_the_last_usage_key_outside_strings() -> None:
    from router.upstream.proxy import usage_of

    chat = b'{"usage": {"prompt_tokens": 9, "completion_tokens": 4, '
    chat += b'"prompt_tokens_details": {"cached_tokens": 8}}}'
    assert usage_of(chat) == (8, 4)
    # SSE: the last chunk's usage wins; a "usage" inside a JSON string is not a key
    sse = b'data: {"usage": {"completion_tokens": 1}}\n\ndata: {"text": "\\"usage\\": {}"}\n\n'
    sse += b'data: {"usage" : {"completion_tokens": 7, "cache_read_input_tokens": 3}}\n\n'
    assert usage_of(sse) == (3, 7)
    assert usage_of(b'data: {"text": "say \\"usage\\": {\\"completion_tokens\\": 5}"}') == (
        None,
        None,
    )
    # a last key whose value does not parse (a cut tail) falls back to the one before
    assert usage_of(b'{"usage": {"output_tokens": 2}} {"usage": {"output_tok') == (None, 2)
    assert usage_of(b'{"usage": null, "x": {"usage": 5}}') == (None, None)
    assert usage_of(b"") == (None, None)
