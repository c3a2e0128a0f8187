"""Which flow inside a tenant a request belongs to, and the tenancy table's flow fields."""

from __future__ import annotations

import json

import pytest

from router.config import ConfigError, load_config
from router.flow.sessions import ResponseChains, session_of
from router.tenancy.tenants import Tenancy


def test_claude_code_session_header_and_metadata() -> None:
    chains = ResponseChains()
    header = {"X-Claude-Code-Session-Id": "s-1"}
    assert session_of("messages", {}, header, chains) == "claude:s-1"
    newer = {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "abc"})}}
    assert session_of("messages", newer, {}, chains) == "claude:abc"
    legacy = {"metadata": {"user_id": "user_ff_account_12_session_9f1c-22"}}
    assert session_of("messages", legacy, {}, chains) == "claude:9f1c-22"
    assert session_of("messages", {"metadata": {"user_id": "alice"}}, {}, chains) == "user:alice"


def test_openai_user_and_nothing() -> None:
    chains = ResponseChains()
    assert session_of("chat", {"user": "u7"}, {}, chains) == "user:u7"
    assert session_of("chat", {"user": "x" * 500}, {}, chains) == ""  # not a name we keep
    assert session_of("chat", {}, {}, chains) == ""


def test_a_responses_chain_is_one_session() -> None:
    chains = ResponseChains()
    second = session_of("responses", {"previous_response_id": "resp_1"}, {}, chains)
    assert second == "chain:resp_1"
    chains.learn(b'{"id": "resp_2", "object": "response"}', second)
    third = session_of("responses", {"previous_response_id": "resp_2"}, {}, chains)
    assert third == second
    conv = {"conversation": {"id": "conv_9"}, "previous_response_id": "resp_2"}
    assert session_of("responses", conv, {}, chains) == "conv:conv_9"


def test_tenancy_table_reads_flow_fields() -> None:
    config = load_config(
        None,
        env={},
        tenants={"a": {"weight": 2.5, "band": "critical", "rpm": 10, "queue_timeout_s": 5}},
    )
    flow = Tenancy(config, env={}).policy_of("a").flow
    assert (flow.weight, flow.band, flow.rpm, flow.tpm) == (2.5, "critical", 10, None)
    assert Tenancy(config, env={}).policy_of("other").flow.band == "standard"


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"band": "urgent"}, "band must be one of critical, standard, sheddable"),
        ({"weight": 0}, "weight must be a positive number"),
        ({"rpm": 1.5}, "rpm must be a positive integer"),
        ({"max_queue": "many"}, "max_queue must be a number"),
    ],
)
def test_bad_flow_fields_name_the_tenant(spec: dict, words: str) -> None:
    config = load_config(None, env={}, tenants={"acme": spec})
    with pytest.raises(ConfigError, match=words) as e:
        Tenancy(config, env={})
    assert "acme" in str(e.value)
