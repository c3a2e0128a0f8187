"""``schedule:`` in the YAML config and today's flags build the same pipelines."""

from __future__ import annotations

import argparse
import random

import pytest
import yaml

from router.config import ConfigError, add_arguments, load_config
from router.schedule import HashRing, from_config, policy_names
from tests.schedule.common import essence, random_fleet, random_request

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
KNOBS = {"load_bound": 1.5, "decode_cost_tokens": 4.0}


def _config(tmp_path, data: dict | None, *flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = list(flags)
    if data is not None:
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(data))
        argv = ["--config", str(path), *argv]
    return load_config(parser.parse_args(argv), env={}).routing  # what scheduling reads


def _decisions(config, n: int = 400) -> list[tuple]:
    policy = from_config(config, HashRing(URLS))
    rng = random.Random(3)
    clock = [0.0]
    policy.recent.clock = lambda: clock[0]
    out = []
    for _ in range(n):
        clock[0] += 0.02
        r = random_request(rng)
        d = policy.choose(r, random_fleet(rng, r, URLS, index=policy.uses_index))
        policy.placed(d)
        out.append(essence(d))
    return out


def _seeded(name: str) -> dict:
    return {"seed": 9} if name in ("random", "least_loaded") else {}


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_from_yaml_decides_as_from_the_old_flags(tmp_path, name):
    from router.schedule.registry import policy_params

    takes = set(type(policy_params(name)).__dataclass_fields__)
    params = {k: v for k, v in KNOBS.items() if k in takes} | _seeded(name)
    from_yaml = _config(tmp_path, {"schedule": {"policy": name, "params": params}})
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in KNOBS.items()]
    from_flags = _config(
        tmp_path,
        {"schedule": {"params": _seeded(name)}} if _seeded(name) else None,
        "--policy",
        name,
        *flags,
    )
    assert from_yaml.policy == from_flags.policy == name
    assert _decisions(from_yaml) == _decisions(from_flags)


def test_a_full_profile_decides_as_the_policy_it_spells_out(tmp_path):
    c = {"load_bound": 1.5}
    profile = {
        "name": "ttft_by_hand",
        "filters": [{"name": "load_bound", "params": c}, {"name": "recent_share", "params": c}],
        "scorers": ["uncached_prefill", "queued_tokens", {"name": "inflight", "weight": 4}],
        "picker": {"name": "ring_min_cost", "params": c},
    }
    custom = _config(tmp_path, {"schedule": profile})
    assert custom.policy == "ttft_by_hand"
    flags = ("--policy", "ttft", "--load-bound", "1.5", "--decode-cost-tokens", "4")
    assert _decisions(custom) == _decisions(_config(tmp_path, None, *flags))
    # A --policy flag beats the file's profile, as flags beat files everywhere.
    assert (
        from_config(_config(tmp_path, {"schedule": profile}, "--policy", "random"), HashRing()).name
        == "random"
    )


def test_flags_beat_the_files_schedule_params(tmp_path):
    data = {"schedule": {"policy": "ttft", "params": {"load_bound": 1.5, "kv_pressure": 500}}}
    config = _config(tmp_path, data, "--load-bound", "2")
    assert config.load_bound == 2.0
    p = from_config(config, HashRing())
    assert p.filters[0].c == 2.0 and p.describe()["scorers"]["kv_pressure"] == 500.0
    assert _config(tmp_path, data).load_bound == 1.5  # the file's value is the setting's


@pytest.mark.parametrize(
    "schedule,message",
    [
        ({"policy": "fastest"}, "unknown policy 'fastest'; choose from ring_spill, "),
        ({"policy": "ttft", "params": {"c": 2}}, "unknown parameter 'c'; valid: load_bound, "),
        ({"policy": "round_robin", "params": {"load_bound": 2}}, "takes no parameters"),
        ({"policy": "ttft", "params": {"kv_pressure": "lots"}}, "kv_pressure must be float"),
        ({"policy": "ttft", "params": {"load_bound": 0.5}}, "load_bound must be >= 1.0"),
        ({"picker": "best"}, "unknown picker 'best'; choose from random, random_min, "),
        ({"scorers": ["speed"], "picker": "random"}, "unknown scorer 'speed'; choose from infl"),
        (
            {"filters": [{"name": "load_bound", "params": {"x": 1}}], "picker": "random"},
            "filter load_bound: unknown parameter 'x'; valid: load_bound",
        ),
        ({"scorers": [{"name": "inflight", "weight": -1}], "picker": "random"}, "weight must be"),
        ({"scorers": ["inflight"]}, "needs a picker"),
        ({"policy": "ttft", "picker": "random"}, "not both"),
        ({"name": "ttft", "picker": "random"}, "is a built-in policy"),
        ({"polcy": "ttft"}, "unknown key 'polcy'; valid: policy, params"),
    ],
)
def test_schedule_errors_name_the_valid_choices(tmp_path, schedule, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _config(tmp_path, {"schedule": schedule})


def test_a_setting_given_twice_in_one_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="set twice"):
        _config(tmp_path, {"policy": "random", "schedule": {"policy": "ttft"}})
