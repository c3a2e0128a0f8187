"""What a tenant may ask of the engine (issue 39, items 10 and 11): engine-control body
fields (``priority``, ``kv_transfer_params``, ``vllm_xargs``) are a 400 naming the field
unless the tenant's entry allows them, on every front end that reaches the replicas; the
gateway sets ``priority`` from the tenant's band when told to; a tenant's ``models:``
allow-list (adapters included) makes every other model the 404 of an unknown one, loads no
adapter for it, and filters ``/v1/models``. Over loopback sockets, a real tokenizer, the
simulated replicas behind a proxy that records what reaches them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.helpers import chat_body, post, serve

QWEN = "Qwen/Qwen3-0.6B"
KEYS = {
    "plain": "sk-plain-0123456789",
    "trusted": "sk-trusted-0123456789",
    "other": "sk-other-0123",
}
ENDPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", chat_body("hello")),
    "completions": ("/v1/completions", {"model": QWEN, "prompt": "hello there", "max_tokens": 2}),
    "messages": (
        "/v1/messages",
        {"model": QWEN, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]},
    ),
    "responses": ("/v1/responses", {"model": QWEN, "input": "hello", "max_output_tokens": 2}),
}


def keys_file(path: Path, **tenants: dict[str, Any]) -> str:
    table = {t: {"keys": [k], **tenants.get(t, {})} for t, k in KEYS.items()}
    path.write_text(yaml.safe_dump({"tenants": table, "salt_secrets": [{"secret": "s" * 32}]}))
    return str(path)


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


class Recorder:
    """A proxy in front of a replica that keeps every POST body it passes on."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.bodies: list[tuple[str, Any]] = []
        self.session = aiohttp.ClientSession()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        if request.method == "POST":
            try:
                self.bodies.append((request.path, json.loads(data)))
            except ValueError:
                self.bodies.append((request.path, None))
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with self.session.request(
            request.method, self.target + request.path_qs, data=data, headers=headers
        ) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "application/json")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype})


@pytest.fixture
async def recorded(fleet) -> AsyncIterator[Callable[..., Awaitable[tuple[Recorder, str, Any]]]]:  # type: ignore[no-untyped-def]
    made: list[tuple[Recorder, web.AppRunner]] = []

    async def make(**sim: Any) -> tuple[Recorder, str, Any]:
        (replica,) = await fleet(1, **sim)
        recorder = Recorder(replica.url)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.handle)
        runner, url = await serve(app)
        made.append((recorder, runner))
        return recorder, url, replica

    yield make
    for recorder, runner in made:
        await recorder.session.close()
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_engine_fields_need_the_tenants_leave(endpoint, recorded, gateway, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each engine-control field from a tenant without ``allow_fields`` is a 400 naming it
    (in the API's own shape), and never reaches the replica; a tenant allowed ``priority``
    gets it through."""
    recorder, url, _ = await recorded()
    keys = keys_file(tmp_path / "keys.yaml", trusted={"allow_fields": ["priority"]})
    gw = await gateway([url], auth=True, api_keys_file=keys)
    path, body = ENDPOINTS[endpoint]
    async with aiohttp.ClientSession() as s:
        for field, value in (
            ("priority", -10),
            ("kv_transfer_params", {"do_remote_prefill": True}),
            ("vllm_xargs", {"x": 1}),
        ):
            status, _, answer = await post(
                s, gw.url + path, {**body, field: value}, bearer("plain")
            )
            assert status == 400, answer
            error = answer["error"]
            assert f"`{field}`" in error["message"]
            if endpoint == "messages":
                assert answer["type"] == "error"  # Anthropic's shape
            else:
                assert error["param"] == field
        status, _, answer = await post(s, gw.url + path, {**body, "priority": 0}, bearer("trusted"))
        assert status == 200, answer
    sent = [b for p, b in recorder.bodies if p == path]
    assert len(sent) == 1 and sent[0]["priority"] == 0


async def test_with_auth_off_engine_fields_pass_through(recorded, gateway) -> None:  # type: ignore[no-untyped-def]
    """The operator with auth off owns the fleet: fields pass as before."""
    recorder, url, _ = await recorded()
    gw = await gateway([url])
    async with aiohttp.ClientSession() as s:
        status, _, answer = await post(
            s, gw.url + "/v1/chat/completions", chat_body("hi", priority=0, vllm_xargs={"a": 1})
        )
    assert status == 200, answer
    (sent,) = [b for p, b in recorder.bodies if p == "/v1/chat/completions"]
    assert sent["vllm_xargs"] == {"a": 1}


async def test_priority_from_the_tenants_band(recorded, gateway, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With flow_band_priority on (replicas with --scheduling-policy priority), each request
    carries its tenant's band as vLLM's priority (lower runs first)."""
    recorder, url, _ = await recorded()
    keys = keys_file(
        tmp_path / "keys.yaml", trusted={"band": "critical"}, other={"band": "sheddable"}
    )
    gw = await gateway([url], auth=True, api_keys_file=keys, flow_band_priority=True)
    async with aiohttp.ClientSession() as s:
        for tenant in ("trusted", "plain", "other"):
            status, _, answer = await post(
                s, gw.url + "/v1/chat/completions", chat_body(tenant), bearer(tenant)
            )
            assert status == 200, answer
    sent = [b["priority"] for p, b in recorder.bodies if p == "/v1/chat/completions"]
    assert sent == [-1, 0, 1]


async def test_a_model_off_the_allow_list_is_an_unknown_one(recorded, gateway, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tenant whose ``models:`` leaves a model or adapter out gets, for it, word for word
    the 404 of a model that does not exist, and no runtime adapter load happens; its
    ``/v1/models`` lists only what it may use."""
    recorder, url, replica = await recorded(allow_runtime_lora=True)
    keys = keys_file(
        tmp_path / "keys.yaml",
        trusted={"models": [QWEN]},  # the base model, not the adapter
        other={"models": ["lora-x"]},
    )
    gw = await gateway(
        [url],
        auth=True,
        api_keys_file=keys,
        models={QWEN: {"adapters": {"lora-x": "/adapters/lora-x"}}},
        lora_runtime_loading=True,
    )

    def answer_for(name: str, answer: dict[str, Any]) -> str:
        return json.dumps(answer).replace(name, "NAME")

    async with aiohttp.ClientSession() as s:
        chat = "/v1/chat/completions"
        status, _, unknown = await post(
            s, gw.url + chat, {**chat_body("x"), "model": "no-such-model"}, bearer("trusted")
        )
        assert status == 404
        status, _, refused = await post(
            s, gw.url + chat, {**chat_body("x"), "model": "lora-x"}, bearer("trusted")
        )
        assert status == 404
        assert answer_for("lora-x", refused) == answer_for("no-such-model", unknown)
        status, _, refused = await post(s, gw.url + chat, chat_body("x"), bearer("other"))
        assert status == 404 and answer_for(QWEN, refused) == answer_for("no-such-model", unknown)
        status, _, _ = await post(s, gw.url + "/tokenize", chat_body("x"), bearer("other"))
        assert status == 404
        status, _, ok = await post(s, gw.url + chat, chat_body("x"), bearer("trusted"))
        assert status == 200, ok

        listed = {}
        for tenant in KEYS:
            async with s.get(gw.url + "/v1/models", headers=bearer(tenant)) as resp:
                listed[tenant] = {c["id"] for c in (await resp.json())["data"]}
    assert not any(p == "/v1/load_lora_adapter" for p, _ in recorder.bodies)
    assert replica.stats.get("adapters_loaded", 0) == 0
    assert listed["trusted"] == {QWEN}
    assert QWEN not in listed["other"]
    assert QWEN in listed["plain"]
