"""The model registry's parts: the models: section, tokenizer discovery (config, root, the
local Hugging Face cache, bundled), block-size reconciliation, the text-prefix fallback and the
drift watch. The registry over real sockets is in tests/test_multimodel.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.bundled import tokenizer_dir
from router.fleet.probes import parse_vllm_metrics
from router.fleet.replicas import Replica
from router.models import (
    ModelRegistry,
    ModelSpecError,
    blocksize,
    fallback,
    parse_models,
    tokenizers,
)
from router.models.drift import DriftWatch
from router.models.spec import alias_map

QWEN = str(tokenizer_dir())


def test_models_section_is_validated() -> None:
    specs = parse_models(
        {
            "a": {"tokenizer": "/t/a", "block_size": 32, "aliases": ["claude-x"]},
            "b": "/t/b",
            "c": None,
        }
    )
    assert specs["a"].block_size == 32 and specs["b"].tokenizer == "/t/b"
    assert specs["c"].tokenizer is None
    assert alias_map(specs, {"gpt-4o": "b"}) == {"claude-x": "a", "gpt-4o": "b"}
    for bad, words in [
        ({"a": {"block_size": 0}}, "block_size must be a positive integer"),
        ({"a": {"tokenizr": "/x"}}, "unknown keys ['tokenizr']"),
        ({"a": {"aliases": [1]}}, "aliases must be a list of names"),
        ({"a": 5}, "expected a mapping"),
    ]:
        with pytest.raises(ModelSpecError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_models(bad)
    with pytest.raises(ModelSpecError, match="alias of both"):
        alias_map(parse_models({"a": {"aliases": ["x"]}, "b": {"aliases": ["x"]}}), None)
    with pytest.raises(ModelSpecError, match="is a configured model"):
        alias_map(parse_models({"a": {}, "b": {"aliases": ["a"]}}), None)


def _hf_snapshot(cache: Path, repo: str, files_from: str) -> Path:
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in Path(files_from).iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0123abcd")
    return snap


def test_tokenizer_sources_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snap = _hf_snapshot(cache, "org/cached-model", QWEN)
    # The HF cache, by root then by name (as vLLM resolves a hub id).
    found = tokenizers.find("served-name", "org/cached-model", None)
    assert found == tokenizers.Found(str(snap), "hf_cache")
    assert tokenizers.find("org/cached-model", None, None) == found
    # HF_HOME when HF_HUB_CACHE is unset.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert tokenizers.find("org/cached-model", None, None) == found
    # A root that is a directory on this host.
    assert tokenizers.find("m", QWEN, None) == tokenizers.Found(QWEN, "root")
    # The config wins over everything; a configured tokenizer that is missing is an error.
    assert tokenizers.find("org/cached-model", None, QWEN).origin == "config"
    with pytest.raises(FileNotFoundError, match="nor a model in the local"):
        tokenizers.find("m", None, str(tmp_path / "nope"))
    # Bundled, for the model the bundled files are; nothing for an unknown model.
    assert tokenizers.find("Qwen/Qwen3-0.6B", None, None).origin == "bundled"
    assert tokenizers.find("someone/unknown", "someone/unknown", None) is None


def test_families_vllm_does_not_template_are_refused_by_name(tmp_path: Path) -> None:
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "tekken.json").write_text("{}")
    with pytest.raises(tokenizers.Unsupported, match="mistral-common"):
        tokenizers.check_family(str(mistral))
    oss = tmp_path / "oss"
    oss.mkdir()
    (oss / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(tokenizers.Unsupported, match="harmony"):
        tokenizers.check_family(str(oss))
    tokenizers.check_family(QWEN)  # the HF template family passes


def test_block_size_groups_and_refusal() -> None:
    g = blocksize.group(
        "m",
        {
            "http://a": ("r", 16),
            "http://b": ("r", 16),
            "http://c": ("r", 32),
            "http://d": ("r", None),
        },
    )
    assert g.block_size == 16 and g.primary == ("http://a", "http://b", "http://d")
    assert g.apart == ("http://c",)
    assert g.warning is not None and "http://c" in g.warning and "32" in g.warning
    roots = blocksize.group(
        "m", {"http://a": ("x", 16), "http://b": ("y", 16), "http://c": ("x", 16)}
    )
    assert roots.primary == ("http://a", "http://c") and roots.apart == ("http://b",)
    with pytest.raises(blocksize.BlockSizeRefused) as e:
        blocksize.check_configured("m", 32, "--block-size", {"http://a": 16, "http://b": None})
    assert "\n" not in str(e.value) and "report block size 16" in str(e.value)
    blocksize.check_configured("m", 16, "--block-size", {"http://a": 16})


def _replica(url: str, cards: list[dict[str, Any]], metrics: str = "") -> Replica:
    r = Replica(url)
    r.cards = {c["id"]: c for c in cards}
    r.models = {c["id"]: c.get("parent") for c in cards}
    r.models_known = True
    r.stats = parse_vllm_metrics(metrics)
    return r


def _cache_info(bs: int) -> str:
    return f'vllm:cache_config_info{{block_size="{bs}",prefix_caching_hash_algo="sha256"}} 1.0\n'


def test_registry_entries_adapters_aliases(caplog: pytest.LogCaptureFixture) -> None:
    reg = ModelRegistry({"Qwen/Qwen3-0.6B": {"aliases": ["claude-haiku"]}})
    replicas = [
        _replica(
            "http://q1",
            [
                {"id": "Qwen/Qwen3-0.6B", "root": "Qwen/Qwen3-0.6B", "max_model_len": 40960},
                {"id": "sql", "root": "/a/sql", "parent": "Qwen/Qwen3-0.6B"},
            ],
            _cache_info(16),
        ),
        _replica("http://u1", [{"id": "org/unknown", "root": "org/unknown"}], _cache_info(32)),
    ]
    assert reg.refresh(replicas) == ["Qwen/Qwen3-0.6B", "org/unknown"]
    for name in reg.entries:
        reg.load(name)
    q, u = reg.entries["Qwen/Qwen3-0.6B"], reg.entries["org/unknown"]
    assert q.basis == "tokens" and q.tokenizer_origin == "bundled" and q.block_size == 16
    assert q.max_model_len == 40960 and q.hash_algo == "sha256" and q.adapters == {"sql"}
    assert u.basis == "text_prefix" and u.block_size == 32 and u.replicas == ("http://u1",)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "org/unknown" in warnings[0] and "models:" in warnings[0]
    route = reg.resolve("claude-haiku")
    assert route is not None and route.entry is q and route.model == "Qwen/Qwen3-0.6B"
    assert route.alias_of == "claude-haiku"
    adapter = reg.resolve("sql")
    assert adapter is not None and adapter.entry is q and adapter.lora == "sql"
    assert reg.resolve("nobody") is None
    # A second refresh finds nothing new and warns no more.
    assert reg.refresh(replicas) == []


def test_registry_refuses_a_contradicted_block_size() -> None:
    reg = ModelRegistry({"m": {"block_size": 32}})
    reg.refresh([_replica("http://a", [{"id": "m", "root": "m"}], _cache_info(16))])
    assert reg.refused is not None and "models.m.block_size 32" in reg.refused
    assert reg.entries["m"].replicas == () and reg.entries["m"].apart == ("http://a",)
    reg = ModelRegistry(flag_block_size=32)
    reg.refresh([_replica("http://a", [{"id": "m", "root": "m"}], _cache_info(16))])
    assert reg.refused is not None and "--block-size" in reg.refused


def test_flag_tokenizer_applies_to_one_model_only() -> None:
    reg = ModelRegistry(flag_tokenizer=QWEN)
    one = [_replica("http://a", [{"id": "a", "root": "a"}])]
    reg.refresh(one)
    assert reg.load("a").tokenizer_origin == "flag"
    two = [*one, _replica("http://b", [{"id": "b", "root": "b"}])]
    reg = ModelRegistry(flag_tokenizer=QWEN)
    reg.refresh(two)
    assert reg.load("a").basis == "text_prefix" and reg.load("b").basis == "text_prefix"


def test_lora_requests_info_names_active_adapters() -> None:
    s = parse_vllm_metrics(
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1.7e9\n'
    )
    assert s.lora_active == {"a", "b", "c"}


def test_text_prefix_fallback_shares_prefixes() -> None:
    sys_ = {"role": "system", "content": "You are a helpful assistant. " * 20}
    one = fallback.prompt_ids({"messages": [sys_, {"role": "user", "content": "first"}]}, {})
    two = fallback.prompt_ids({"messages": [sys_, {"role": "user", "content": "second"}]}, {})
    other = fallback.prompt_ids({"messages": [{"role": "user", "content": "first"}]}, {})
    common = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
    assert common >= 140 and one[0] != other[0]
    assert fallback.prompt_ids(None, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert len(fallback.prompt_ids(None, {"prompt": "abcdefgh"})) == 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-5, 300), st.integers(0, 300)), max_size=120),
    st.integers(1, 30),
)
def test_drift_ratio_kept_as_running_sums_equals_the_window_sum(
    reports: list[tuple[int, int]], window: int
) -> None:
    w = DriftWatch(window=window, min_samples=1)
    for predicted, reported in reports:
        w.observe(predicted, reported)
        total = sum(p for p, _ in w.samples)
        over = sum(max(0, p - r) for p, r in w.samples)
        assert w.ratio() == (over / total if total else 0.0)


def test_drift_watch_flags_consistent_over_prediction() -> None:
    w = DriftWatch(window=10, min_samples=5, threshold=0.2)
    assert all(w.observe(64, 64) is None for _ in range(10))
    changes = [w.observe(64, 16) for _ in range(10)]
    assert changes.count(True) == 1 and w.flagged and w.ratio() > 0.5
    assert w.observe(0, 0) is None  # nothing predicted: nothing learnt
    back = [w.observe(64, 80) for _ in range(10)]  # under-prediction is not drift
    assert back.count(False) == 1 and not w.flagged
