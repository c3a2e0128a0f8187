"""Multi-tenancy end to end: API keys, salt policies, public prefixes, rotation, no leaks.

Every isolation test runs on ONE simulated replica, so two requests that could share cached
blocks really would: a cached token that crossed tenants could not hide behind routing.
Cached tokens are read from what the replica reports (``usage.prompt_tokens_details``), and
each response's predicted blocks (``x-prefix-router-cached-blocks``) must equal what the
replica reused: the salt the gateway hashes with is the salt it sends.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from router.config import ConfigError, load_config
from router.core.salt import validate_cache_salt
from router.tenancy.tenants import Tenancy
from tests.helpers import LONG_SYSTEM, chat_body, post, wait_for

BLOCKS_HDR = "x-prefix-router-cached-blocks"
BLOCK = 16  # the simulated replicas' block size, which the gateway reads from them

KEYS = {
    "acme": "sk-acme-7f3e9a1c5b2d4e6f8a0b1c2d",
    "globex": "sk-globex-0a9b8c7d6e5f4a3b2c1d0e9f",
    "initech": "sk-initech-5e4d3c2b1a0f9e8d7c6b",  # stored as a sha256 digest only
    "hooli": "sk-hooli-1b2c3d4e5f60718293a4b5c6",
    "vandelay": "sk-vandelay-9f8e7d6c5b4a39281706",
    "strict": "sk-strict-2c4e6a8b0d1f3e5a7c9b",
    "pub1": "sk-pub1-4a6c8e0b2d4f6a8c0e2b",
    "pub2": "sk-pub2-6e8a0c2e4b6d8f0a2c4e",
    "nopub": "sk-nopub-8c0e2a4c6e8b0d2f4a6c",
}
WRONG_KEY = "sk-wrong-3d5f7b9a1c3e5a7b9d1f"
SECRET_A = "rotation-secret-a-6b7c8d9e0f1a2b3c"
ADMIN_KEY = "admin-key-5e6f7a8b9c0d1e2f3a4b"
SECRET_B = "rotation-secret-b-1f2e3d4c5b6a7980"
PUBLIC_SYSTEM = "Published support prompt of the ACME marketplace. " + LONG_SYSTEM


def keys_file(
    path: Path,
    secrets: list[dict[str, Any]] | None = None,
    tenants: list[str] | None = None,
) -> Path:
    """Write an api_keys_file with ``tenants`` (default: all of KEYS)."""
    policies = {
        "initech": "tenant+client",
        "hooli": "none",
        "vandelay": "none",
        "strict": "reject",
    }
    out: dict[str, Any] = {
        "salt_secrets": secrets or [{"secret": SECRET_A, "not_before": 0, "epoch": "a"}],
        "public_prefixes": {"support": PUBLIC_SYSTEM},
        "tenants": {},
    }
    for name in tenants or list(KEYS):
        spec: dict[str, Any] = {}
        if name == "initech":
            spec["key_sha256"] = [hashlib.sha256(KEYS[name].encode()).hexdigest()]
        else:
            spec["keys"] = [KEYS[name]]
        if name in policies:
            spec["salt_policy"] = policies[name]
        if name in ("pub1", "pub2"):
            spec["public_prefixes"] = ["support"]
        out["tenants"][name] = spec
    path.write_text(yaml.safe_dump(out))
    return path


def cached(body: Any) -> int:
    """Cached prompt tokens the replica reported; vLLM omits the details on a miss."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


class Client:
    """Posts chat requests as a tenant and checks prediction == what the replica reused."""

    def __init__(self, session: aiohttp.ClientSession, gw: Any, replica: Any) -> None:
        self.s, self.gw, self.replica = session, gw, replica

    async def chat(
        self, body: dict[str, Any], tenant: str | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        hdrs = {**(bearer(tenant) if tenant else {}), **(headers or {})}
        status, h, b = await post(self.s, self.gw.url + "/v1/chat/completions", body, hdrs)
        assert status == 200, b
        assert cached(b) == int(h[BLOCKS_HDR]) * BLOCK, (cached(b), h[BLOCKS_HDR])
        return cached(b), b

    def last_salt(self) -> str | None:
        """The cache_salt the replica received with the last request."""
        return self.replica.stats["records"][-1]["cache_salt"]

    def last_epoch(self) -> str:
        """The ``pr<epoch>-`` part of the last salt the replica received ("" if unsalted)."""
        return (self.last_salt() or "").partition("-")[0]


async def tenant_gateway(tmp_path: Path, fleet: Any, gateway: Any, **overrides: Any) -> Any:
    replicas = await fleet(1)
    path = keys_file(tmp_path / "keys.yaml")
    overrides.setdefault("decision_headers", True)  # off by default with auth on
    gw = await gateway([replicas[0].url], auth=True, api_keys_file=str(path), **overrides)
    return gw, replicas[0], path


# -- isolation ---------------------------------------------------------------------------------


async def test_identical_prompts_never_share_across_tenants(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    body = chat_body("What is my balance?")
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        assert (await c.chat(body, "acme"))[0] == 0
        acme_salt = c.last_salt()
        assert (await c.chat(body, "acme"))[0] > 0  # within a tenant: hits
        assert (await c.chat(body, "globex"))[0] == 0  # byte-identical, other tenant: nothing
        globex_salt = c.last_salt()
        assert (await c.chat(body, "globex"))[0] > 0
        assert (await c.chat(body, "acme"))[0] > 0  # globex did not disturb acme's scope
    assert acme_salt and globex_salt and acme_salt != globex_salt
    for salt in (acme_salt, globex_salt):
        validate_cache_salt(salt)
        assert salt.startswith("pra-") and len(salt) <= 128
    # The gateway's own decision is what the replica got (and hashed with, see Client.chat).
    messages = body["messages"]
    assert gw.gateway.tenancy.salt("acme", None, messages).salt == acme_salt


async def test_another_tenants_salt_value_gains_nothing(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    body = chat_body("Show the pending invoices of this month.")
    # Acme's salt, computed the way the gateway derives it (an attacker who somehow learnt
    # the value, e.g. from a replica log); the replica side must agree.
    mac = hmac.new(SECRET_A.encode(), json.dumps(["tenant", "acme"]).encode(), hashlib.sha256)
    acme_salt = "pra-" + mac.hexdigest()[:48]
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        await c.chat(body, "acme")
        assert c.last_salt() == acme_salt
        assert (await c.chat(body, "acme"))[0] > 0
        stolen = {**body, "cache_salt": acme_salt}
        for tenant in ("globex", "initech", "hooli"):  # tenant, tenant+client, none
            hit, _ = await c.chat(stolen, tenant)
            assert hit == 0, tenant
            assert c.last_salt() != acme_salt, tenant
        # tenant+client: the client's salt splits the tenant's own scope, nothing more.
        assert (await c.chat({**body, "cache_salt": "user-1"}, "initech"))[0] == 0
        assert (await c.chat({**body, "cache_salt": "user-1"}, "initech"))[0] > 0
        assert (await c.chat({**body, "cache_salt": "user-2"}, "initech"))[0] == 0


async def test_none_tenants_share_with_each_other(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    body = chat_body("List the open tickets.")
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        assert (await c.chat(body, "hooli"))[0] == 0
        assert c.last_salt() is None
        assert (await c.chat(body, "vandelay"))[0] > 0  # the fleet cache is shared
        assert (await c.chat(body, "acme"))[0] == 0  # a salted tenant stays out of it


async def test_reject_policy_and_bad_salts_are_400(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    url = gw.url + "/v1/chat/completions"
    bad: list[Any] = ["x" * 129, "a@b", "a/b", "a\\b", "a\x00b", "", 7, True, ["x"], {"k": "v"}]
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, url, chat_body("hi", cache_salt="mine"), bearer("strict"))
        assert status == 400 and body["error"]["param"] == "cache_salt"
        assert body["error"]["type"] == "BadRequestError"
        c = Client(s, gw, replica)
        await c.chat(chat_body("hi"), "strict")
        assert c.last_epoch() == "pra"  # reject still salts
        for tenant in ("acme", "initech", "hooli"):
            for salt in bad:
                status, _, body = await post(
                    s, url, chat_body("hi", cache_salt=salt), bearer(tenant)
                )
                assert status == 400, (tenant, salt)
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert body["error"]["param"] == "cache_salt"
        await c.chat(chat_body("hi", cache_salt="x" * 128), "initech")  # the limit itself is fine
    assert replica.stats["errors"] == 0  # every bad salt stopped at the gateway


async def test_missing_or_wrong_key_is_401_in_openai_shape(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    cases = [
        {},
        {"Authorization": f"Bearer {WRONG_KEY}"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {KEYS['acme']}"},
        {"Authorization": KEYS["acme"]},
    ]
    async with aiohttp.ClientSession() as s:
        for path, body in (
            ("/v1/chat/completions", chat_body("hi")),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ):
            for headers in cases:
                status, _, err = await post(s, gw.url + path, body, headers)
                assert status == 401, (path, headers)
                assert set(err["error"]) == {"message", "type", "param", "code"}
                assert err["error"]["code"] == "invalid_api_key"
                assert err["error"]["type"] == "AuthenticationError"
                assert WRONG_KEY not in json.dumps(err) and KEYS["acme"] not in json.dumps(err)
    assert replica.stats["requests"] == 0


async def test_auth_off_tenant_header_names_the_tenant(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway(
        [replicas[0].url], tenant_header="X-Tenant", salt_policy="tenant", salt_secret=SECRET_A
    )
    body = chat_body("Where is my order?")
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replicas[0])
        assert (await c.chat(body, headers={"X-Tenant": "red"}))[0] == 0
        assert (await c.chat(body, headers={"X-Tenant": "red"}))[0] > 0
        assert (await c.chat(body, headers={"X-Tenant": "blue"}))[0] == 0
        assert (await c.chat(body))[0] == 0  # no header: the "default" tenant
        assert (await c.chat(body, headers={"X-Tenant": "blue"}))[0] > 0
        async with s.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    for tenant in ("red", "blue", "default"):
        assert f'prefix_router_tenant_requests_total{{tenant="{tenant}"}}' in text


async def test_auth_off_default_passes_the_client_salt_through(fleet, gateway):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replicas[0])
        await c.chat(chat_body("hello", cache_salt="team-7"))
        assert c.last_salt() == "team-7"
        assert (await c.chat(chat_body("hello", cache_salt="team-7")))[0] > 0
        assert (await c.chat(chat_body("hello")))[0] == 0
        assert c.last_salt() is None


# -- public prefixes -----------------------------------------------------------------------


async def test_public_prefix_is_shared_only_by_tenants_allowed(tmp_path, fleet, gateway):
    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    system_tokens = len(gw.gateway.renderer.tokenize_chat(chat_body("", system=PUBLIC_SYSTEM)))
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        assert (await c.chat(chat_body("First question", system=PUBLIC_SYSTEM), "pub1"))[0] == 0
        assert c.last_salt() is None  # sent unsalted: the trade-off
        hit, _ = await c.chat(chat_body("Another question", system=PUBLIC_SYSTEM), "pub2")
        assert hit >= (system_tokens // BLOCK - 2) * BLOCK  # the published prompt, shared
        # A client salt under `tenant` is ignored, so it does not opt out of sharing.
        hit, _ = await c.chat(
            chat_body("Third question", system=PUBLIC_SYSTEM, cache_salt="x1"), "pub2"
        )
        assert hit > 0 and c.last_salt() is None
        # A tenant not allowed to share it stays salted and gets nothing from the others.
        assert (await c.chat(chat_body("Another question", system=PUBLIC_SYSTEM), "nopub"))[0] == 0
        assert c.last_salt() is not None
        # An allowed tenant's private system prompt is salted as usual.
        await c.chat(chat_body("Private", system="Pub1 private prompt. " + LONG_SYSTEM), "pub1")
        assert c.last_salt() is not None
        hit, _ = await c.chat(
            chat_body("Private", system="Pub1 private prompt. " + LONG_SYSTEM), "pub2"
        )
        assert hit == 0


# -- rotation and reload -------------------------------------------------------------------


def test_rotation_schedule_picks_the_secret_in_force(tmp_path):
    now = time.time()
    secrets: list[dict[str, Any]] = [
        {"secret": SECRET_A, "not_before": now - 60, "epoch": "a"},
        {
            "secret": SECRET_B,
            "not_before": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 3600)),
            "epoch": "b",
        },
    ]
    path = keys_file(tmp_path / "keys.yaml", secrets)
    t = Tenancy(load_config(None, env={}, auth=True, api_keys_file=str(path)), env={})
    epoch = {when: getattr(t.current_secret(when), "epoch", None) for when in (now, now + 3601)}
    assert epoch == {now: "a", now + 3601: "b"}
    assert getattr(t.current_secret(now - 3600), "epoch", None) == "a"  # before all: the earliest
    assert str(t.salt("acme", None).salt).startswith("pra-")


async def test_secret_switches_at_not_before_and_keys_file_reloads(tmp_path, fleet, gateway):
    replicas = await fleet(1)
    replica = replicas[0]
    switch = time.time() + 2.0
    secrets = [
        {"secret": SECRET_A, "not_before": 0, "epoch": "a"},
        {"secret": SECRET_B, "not_before": switch, "epoch": "b"},
    ]
    path = keys_file(tmp_path / "keys.yaml", secrets, tenants=["acme"])
    gw = await gateway([replica.url], auth=True, api_keys_file=str(path), decision_headers=True)
    body = chat_body("Summarise my account.")
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        epochs: list[str] = []

        # The scheduled secret takes over at its instant, with no file change and no restart:
        # a request that finished before it carries epoch a, one that started after it b.
        async def switched() -> bool:
            started = time.time()
            await c.chat(chat_body("ping", system="Ping."), "acme")
            epoch, finished = c.last_epoch(), time.time()
            epochs.append(epoch)
            assert epoch == ("pra" if finished < switch else "prb" if started > switch else epoch)
            return epoch == "prb"

        await wait_for(switched, timeout=10, what="the epoch-b secret")
        assert time.time() >= switch and set(epochs) <= {"pra", "prb"}
        # The cost: the salted tenant's cache is cold once, then warm again.
        assert (await c.chat(body, "acme"))[0] == 0
        assert (await c.chat(body, "acme"))[0] > 0

        # A new tenant added to the keys file is picked up without a restart.
        status, _, _ = await post(s, gw.url + "/v1/chat/completions", body, bearer("globex"))
        assert status == 401
        keys_file(path, secrets, tenants=["acme", "globex"])

        async def globex_accepted() -> bool:
            st, _, _ = await post(s, gw.url + "/v1/chat/completions", body, bearer("globex"))
            return st == 200

        await wait_for(globex_accepted, timeout=10, what="the reloaded keys file")
        assert (await c.chat(body, "globex"))[0] > 0  # its first request above warmed it
        assert (await c.chat(body, "acme"))[0] > 0  # acme's scope is untouched


def test_bad_reload_keeps_the_previous_table(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    path = keys_file(tmp_path / "keys.yaml", tenants=["acme"])
    t = Tenancy(load_config(None, env={}, auth=True, api_keys_file=str(path)), env={})
    before = t.table
    # Broken YAML on the very line that holds a key: the error must not quote it.
    path.write_text(f"tenants:\n  acme: x\n    keys: [{KEYS['acme']}]\n")
    t.maybe_reload(force=True)
    # No secret at all: the salted tenants could not be served, so keep the old table.
    path.write_text(yaml.safe_dump({"tenants": {"acme": {"keys": [KEYS["acme"]]}}}))
    t.maybe_reload(force=True)
    assert t.table is before
    assert t.identify({"Authorization": f"Bearer {KEYS['acme']}"}) == "acme"
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "keeping the previous tenants" in m]) == 2, messages
    assert KEYS["acme"] not in caplog.text and SECRET_A not in caplog.text


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,message",
    [
        ({"tenants": {"a": {"keys": ["k1"], "salt_policy": "passthrough"}}}, "auth off only"),
        ({"salt_secrets": [{"secret": SECRET_A, "epoch": "x/y"}]}, "epoch"),
        ({"salt_secrets": [{"secret": "short"}]}, "at least 16"),
        ({"tenants": {"a": {"key_sha256": ["not-a-digest"]}}}, "64 hex"),
        ({"tenants": {"a": {"keys": [WRONG_KEY]}, "b": {"keys": [WRONG_KEY]}}}, "one API key"),
        ({"tenants": {"a": {"keys": ["k1"], "public_prefixes": ["nope"]}}}, "unknown public"),
        ({"tenants": {"a": {"keys": ["k1"], "salt_policy": "bogus"}}}, "salt_policy"),
        ({"tenants": ["a"]}, "mapping"),
    ],
)
def test_config_errors(tmp_path, data, message):
    data = {"salt_secrets": [{"secret": SECRET_A}], **data}
    if "tenants" not in data:
        data["tenants"] = {"a": {"keys": ["k1"]}}
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_config(None, env={}, auth=True, api_keys_file=str(path))
    with pytest.raises(ConfigError, match=message) as e:
        Tenancy(config, env={})
    assert WRONG_KEY not in str(e.value) and SECRET_A not in str(e.value)


def test_keys_from_environment_and_config_overrides(tmp_path):
    path = keys_file(tmp_path / "keys.yaml", tenants=["acme"])
    config = load_config(
        None,
        env={},
        auth=True,
        api_keys_file=str(path),
        tenants={"acme": {"salt_policy": "none"}},  # overrides the policy, keeps the keys
    )
    t = Tenancy(config, env={"PREFIX_ROUTER_API_KEYS": f"envco:{WRONG_KEY}, other:sk-other-0011"})
    assert t.identify({"Authorization": f"Bearer {KEYS['acme']}"}) == "acme"
    assert t.policy_of("acme").salt_policy == "none"
    assert t.identify({"Authorization": f"Bearer {WRONG_KEY}"}) == "envco"
    assert t.identify({"Authorization": "Bearer sk-other-0011"}) == "other"
    assert t.policy_of("envco").salt_policy == "tenant"  # the default with auth on
    assert all(WRONG_KEY not in d and KEYS["acme"] not in d for d in t.table.keys)
    # A single string is one key, not a list of one-character keys.
    path.write_text(yaml.safe_dump({"salt_secrets": SECRET_A, "tenants": {"a": {"keys": "k1"}}}))
    t = Tenancy(load_config(None, env={}, auth=True, api_keys_file=str(path)), env={})
    assert list(t.table.keys.values()) == ["a"]


# -- nothing secret in logs or metrics ------------------------------------------------------


async def test_no_key_or_secret_in_logs_or_metrics(tmp_path, fleet, gateway, caplog):
    caplog.set_level(logging.DEBUG)
    gw, replica, path = await tenant_gateway(tmp_path, fleet, gateway, admin_key=ADMIN_KEY)
    url = gw.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        c = Client(s, gw, replica)
        for tenant in ("acme", "globex", "initech", "hooli"):
            await c.chat(chat_body("hello there"), tenant)
            assert (await c.chat(chat_body("hello again"), tenant))[0] > 0
        for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}):
            assert (await post(s, url, chat_body("x"), headers))[0] == 401
        assert (await post(s, url, chat_body("x", cache_salt="a/b"), bearer("acme")))[0] == 400
        # A reload, and a broken file that quotes a key on its broken line.
        path.write_text(f"tenants:\n  acme: x\n    keys: [{KEYS['acme']}]\n")
        gw.gateway.tenancy.maybe_reload(force=True)
        keys_file(path)
        gw.gateway.tenancy.maybe_reload(force=True)
        await c.chat(chat_body("after reload"), "acme")
        # With auth on, /metrics (tenant names, counts, replica URLs) is the admin's only.
        for headers in ({}, bearer("acme"), {"X-Admin-Key": "wrong"}):
            async with s.get(gw.url + "/metrics", headers=headers) as resp:
                assert resp.status == 401, headers
                assert "acme" not in await resp.text()
        async with s.get(gw.url + "/metrics", headers={"X-Admin-Key": ADMIN_KEY}) as resp:
            metrics = await resp.text()
        async with s.get(
            gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as r:
            assert r.status == 200  # what Prometheus' `authorization` scrape setting sends
    logged = caplog.text + "\n".join(str(r.args) for r in caplog.records)
    assert "keeping the previous tenants" in logged and "reloaded" in logged
    for secret in [*KEYS.values(), WRONG_KEY, SECRET_A, ADMIN_KEY]:
        assert secret not in logged, secret
        assert secret not in metrics, secret
    for tenant in ("acme", "globex", "initech", "hooli"):
        assert f'prefix_router_tenant_requests_total{{tenant="{tenant}"}}' in metrics
        assert f'prefix_router_reported_cached_tokens_total{{tenant="{tenant}"}}' in metrics
        assert f'prefix_router_predicted_cached_tokens_total{{tenant="{tenant}"}}' in metrics


async def test_anthropic_clients_authenticate_with_x_api_key(tmp_path, fleet, gateway):
    """The Anthropic SDK sends its key as x-api-key: with auth on it names the tenant (and
    is not forwarded); a wrong one is a 401 in Anthropic's shape."""
    import anthropic

    gw, replica, _ = await tenant_gateway(tmp_path, fleet, gateway)
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["acme"], max_retries=0)
    msg = await client.messages.create(
        model="Qwen/Qwen3-0.6B", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.content[0].text
    assert replica.stats["records"][-1]["cache_salt"]  # salted as tenant acme
    wrong = anthropic.AsyncAnthropic(base_url=gw.url, api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        await wrong.messages.create(
            model="Qwen/Qwen3-0.6B", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["type"] == "error" and WRONG_KEY not in json.dumps(e.value.body)
    await client.close()
    await wrong.close()
