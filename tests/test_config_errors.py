"""Configuration: every problem reported at once (with a did-you-mean for a misspelt flag or
key), --auth's missing settings together, and nested YAML sections beside the flat keys,
flags and PREFIX_ROUTER_* names."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router import cli
from router.config import FIELDS, SECTIONS, Config, ConfigError, load_config
from router.config.load import REPEATED_FLAGS

ROOT = Path(__file__).resolve().parent.parent
DEAD = "http://127.0.0.1:9"


def from_yaml(tmp_path: Path, data: object, env: dict[str, str] | None = None) -> Config:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(argparse.Namespace(config=str(path)), env=env or {})


def serve_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    try:
        status = cli.main(["serve", *argv])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in err, err
    assert "starting" not in out  # refused before anything starts
    return err.strip().splitlines()


def test_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            env={"PREFIX_ROUTER_PORT": "nope", "PREFIX_ROUTER_LOAD_BOUND": "0.5"},
            replicas=["10.0.0.1:8000"],
            block_size=0,
            redis_url="http://127.0.0.1:6379",
            policy="fastest",
        )
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 6, text
    for words in ("PORT", "load_bound", "http://", "block_size", "redis://", "fastest"):
        assert words in text, words


def test_the_command_lists_them_one_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("blok_size: 16\nfleet:\n  prefx: x\nmax_retries: many\n")
    lines = serve_errors(["--replica", DEAD + "/v1", "--config", str(cfg)], capsys)
    assert lines[0] == "prefix-router serve: 4 problems, all of them listed:", lines
    body = "\n".join(lines[1:])
    assert len(lines) == 5 and all(x.startswith("  - ") for x in lines[1:]), lines
    assert "unknown key 'blok_size' (did you mean 'block_size'?)" in body
    assert "unknown key 'prefx' in section 'fleet' (did you mean 'prefix'?)" in body
    assert "max_retries must be int, got 'many'" in body
    assert f"ends in /v1: give vLLM's base URL ({DEAD})" in body


def test_a_misspelt_flag_gets_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = serve_errors(["--replica", DEAD, "--blok-size", "16"], capsys)
    assert "--blok-size: did you mean --block-size?" in line


def test_auth_reports_every_missing_setting(capsys: pytest.CaptureFixture[str]) -> None:
    lines = serve_errors(["--replica", DEAD, "--auth"], capsys)
    assert lines[0].endswith("2 problems, all of them listed:"), lines
    assert "server secret" in lines[1] and "salt_secret" in lines[1]
    assert "no API keys" in lines[2] and "PREFIX_ROUTER_API_KEYS" in lines[2]


def test_redis_url_with_the_wrong_scheme_is_one_line() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFIX_ROUTER_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--replica", DEAD]
        + ["--redis-url", "http://127.0.0.1:6379", "--tokenizer", "Qwen/Qwen3-0.6B"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "redis_url must start with redis://" in lines[0], lines
    assert "Unclosed" not in done.stderr and "ValueError" not in done.stderr


def test_nested_sections_set_what_the_flat_keys_set(tmp_path: Path) -> None:
    flat = {
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_prefix": "pr",
        "kv_events": True,
        "kv_events_port": 5999,
        "auth": True,
        "salt_secret": "s" * 32,
        "tenants": {"a": {"keys": ["k" * 24]}},
        "max_body_bytes": 1024,
        "max_inflight_body_bytes": 4096,
        "block_size": 32,
        "host": "0.0.0.0",
    }
    nested = {
        "fleet": {"url": "redis://127.0.0.1:6379/0", "redis_prefix": "pr"},
        "kv_events": {"enabled": True, "port": 5999},
        "auth": {"enabled": True, "salt_secret": "s" * 32, "tenants": {"a": {"keys": ["k" * 24]}}},
        "limits": {"max_body_bytes": 1024, "max_inflight_body_bytes": 4096},
        "routing": {"block_size": 32},
        "server": {"host": "0.0.0.0"},
    }
    assert from_yaml(tmp_path, nested) == from_yaml(tmp_path, flat)
    # The environment and flags still win over a section.
    env = {"PREFIX_ROUTER_KV_EVENTS_PORT": "6000"}
    assert from_yaml(tmp_path, nested, env).kv_events.kv_events_port == 6000


def test_a_setting_given_twice_in_the_file_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"redis_url is set twice \((fleet.url and redis_url|redis_url and fleet.url)\)",
    ):
        from_yaml(tmp_path, {"redis_url": "redis://a/0", "fleet": {"url": "redis://b/0"}})


def test_sections_name_real_fields_once() -> None:
    names = set(FIELDS)
    seen: list[str] = []
    for section in SECTIONS.values():
        seen += section.fields
        assert set(section.fields) <= names
        assert section.enabled is None or section.enabled in names
    assert len(seen) == len(set(seen)) == len(names)  # every field in exactly one section
    assert not set(SECTIONS) & (names - {"auth", "kv_events"})  # only switches share a name
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(Config)}


# A value unlike the default for every field, in the form each source gives it.
def _sample(name: str) -> tuple[object, str]:
    """(the value as a YAML file gives it, as a flag or environment variable gives it)."""
    default = FIELDS[name].field.default
    if name == "replicas":
        return ["http://10.0.0.7:8000"], "http://10.0.0.7:8000"
    if name in ("prefill_replicas", "decode_replicas"):
        url = f"http://10.0.0.{8 if name == 'prefill_replicas' else 9}:8000"
        return [url], url
    if name in ("forward_headers", "admin_networks"):
        return ["10.1.0.0/16"], "10.1.0.0/16"
    special: dict[str, object] = {
        "port": 8123,
        "metrics_port": 9123,
        "kv_events_port": 6123,
        "kv_events_replay_port": 6124,
        "discovery_port": 8124,
        "log_level": "debug",
        "policy": "round_robin",
        "pd_prefill_policy": "least_loaded",
        "pd_decode_policy": "round_robin",
        "pd_order": "prefill-first",
        "salt_policy": "tenant",
        "redis_url": "redis://10.0.0.9:6379/0",
        "redis_layout": "zsets",
        "outlier_error_ratio": 0.25,
        "client_share": 0.5,
        "flow_kv_usage_max": 0.5,
        "kv_events_offload_weight": 0.25,
        "max_ejected_percent": 25.0,
        "max_inflight_body_bytes": 2**30,
        "tokenizer": "/nonexistent/tokenizer",
    }
    if name in special:
        value = special[name]
    elif "bool" in str(FIELDS[name].type):
        value = not default
    elif "int" in str(FIELDS[name].type):
        value = (default or 0) + 3
    elif "float" in str(FIELDS[name].type):
        value = (default or 0.0) + 1.5
    else:
        value = f"{name}-x"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return value, text


FLAT_SETTABLE = [n for n, ref in FIELDS.items() if ref.field.metadata.get("flag", True)]


def test_every_flat_key_env_name_and_flag_sets_its_section_field(tmp_path: Path) -> None:
    """The flat names keep working in all three forms, and land where the code reads them."""
    samples = {name: _sample(name) for name in FLAT_SETTABLE}
    expected = {name: value for name, (value, _) in samples.items()}
    flat = from_yaml(tmp_path, expected)
    env = load_config(env={"PREFIX_ROUTER_" + n.upper(): text for n, (_, text) in samples.items()})
    parser = argparse.ArgumentParser()
    from router.config import add_arguments

    add_arguments(parser)
    argv: list[str] = []
    for name, (value, text) in samples.items():
        flag = REPEATED_FLAGS.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, text]
    flags = load_config(parser.parse_args(argv), env={})
    for name, value in expected.items():
        ref = FIELDS[name]
        for config in (flat, env, flags):
            assert getattr(getattr(config, ref.section), ref.attr) == value, (name, config)
            assert config.get(name) == value
    assert flat == env == flags


def test_every_field_can_be_given_inside_its_section(tmp_path: Path) -> None:
    samples = {name: _sample(name)[0] for name in FLAT_SETTABLE}
    samples["models"] = {"m": {"tokenizer": "/nonexistent/tokenizer"}}
    samples["tenants"] = {"a": {"keys": ["k" * 24]}}
    nested: dict[str, dict[str, object]] = {}
    for name, value in samples.items():
        ref = FIELDS[name]
        nested.setdefault(ref.section, {})[ref.attr] = value  # the name the code reads
    assert from_yaml(tmp_path, nested) == from_yaml(tmp_path, samples)
    # P/D's lists by role, inside their section
    pd = {"disaggregation": {"prefill": ["http://p:1"], "decode": ["http://d:1"]}}
    config = from_yaml(tmp_path, pd)
    assert config.disaggregation.prefill_replicas == ["http://p:1"]
    assert config.disaggregation.decode_replicas == ["http://d:1"]
    # the flat names and the names without a section's prefix are accepted inside it too
    short = {"flow": {"enabled": True, "max_queue": 7}, "discovery": {"dns": "gw.local"}}
    longer = {"flow": {"flow_control": True, "flow_max_queue": 7}, "discovery_dns": "gw.local"}
    config = from_yaml(tmp_path, short)
    assert config == from_yaml(tmp_path, longer)
    assert config.flow.enabled and config.flow.flow_max_queue == 7
    assert config.discovery.discovery_dns == "gw.local"
