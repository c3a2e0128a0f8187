"""LoRA adapters inside flow control and runtime loading, over real sockets: simulated
replicas serving adapters (or loading them at run time, answering as vLLM 0.34 does) and a
gateway in front. An adapter's requests share its base model's queue, slots and bounds; one
load per (replica, adapter) is in flight at a time; a replica that refuses a load is not
failing and is not ejected for it."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.helpers import chat_body, post
from tests.test_flow import MODEL, Setup, finish

FLOOD_ADAPTERS = [f"flood-lora-{i}" for i in range(4)]


async def test_a_flood_spread_over_adapter_names_waits_in_its_base_models_queue(
    fleet: Any, gateway: Any
) -> None:
    """Tenant flood sends eight requests over four adapter names while the fleet's one
    prefill slot is held; quiet sends one for the base model after them. Keyed by the base
    model, the flood waits in the same queue as quiet, and quiet is served in its fair turn
    (first or second). Keyed by name (before), each adapter had its own empty queue and
    free slots: the flood went straight to the replica and quiet was served after all of it."""
    (replica,) = await fleet(1, lora_adapters=FLOOD_ADAPTERS)
    gw = await gateway([replica.url], flow_control=True, tenant_header="X-Tenant")
    async with aiohttp.ClientSession() as http:
        setup = Setup(replica, gw, http)
        await setup.hold()
        tasks = [
            await setup.enqueue(f"flood{i}", "flood", i, model=FLOOD_ADAPTERS[i % 4])
            for i in range(8)
        ]
        tasks.append(await setup.enqueue("quiet0", "quiet", 0))
        assert setup.queued == 9  # all waiting, in one queue: the base model's
        assert set(gw.gateway.flow.queues) == {MODEL}
        await setup.release()
        results = await finish(tasks)
    assert [r[0] for r in results] == [200] * 9
    order = setup.served()
    assert len(order) == 9
    assert order.index("quiet0") <= 1, order
    assert gw.gateway.flow.in_prefill(MODEL) == 0


async def test_concurrent_requests_for_an_unloaded_adapter_make_one_load_call_per_replica(
    fleet: Any, gateway: Any
) -> None:
    """20 requests at once for an adapter no replica has; a load takes 0.3 s (vLLM reads the
    weights). Before, every request that reached a replica before the load finished made its
    own /v1/load_lora_adapter call (the later ones answered "already loaded")."""
    replicas = await fleet(2, allow_runtime_lora=True, lora_load_s=0.3)
    gw = await gateway(
        [r.url for r in replicas],
        models={MODEL: {"adapters": {"new-lora": "/adapters/new-lora"}}},
        lora_runtime_loading=True,
    )
    async with aiohttp.ClientSession() as http:
        b = chat_body("hello adapter", model="new-lora")
        results = await finish([post(http, gw.url + "/v1/chat/completions", b) for _ in range(20)])
    assert [r[0] for r in results] == [200] * 20
    calls = [r.stats.get("adapter_load_calls", 0) for r in replicas]
    assert sum(calls) >= 1 and max(calls) == 1, calls


async def test_a_refused_adapter_load_is_a_404_and_never_ejects_the_replica(
    fleet: Any, gateway: Any
) -> None:
    """Two replicas refuse the adapter as vLLM does: one without runtime updates (the route
    is not mounted: 404), one that finds nothing at the path (404 NotFoundError). Repeated
    requests get a 404 naming the adapter (not the replica-side path), each replica is asked
    at most once (the refusal is remembered), nobody is ejected, and the base model is
    served. Before, each refusal was the replica's failure: retried, counted, and after
    three the replica was ejected (the client got a 502)."""
    (off,) = await fleet(1)
    (missing,) = await fleet(1, allow_runtime_lora=True, lora_missing_paths=["/adapters/bad"])
    gw = await gateway(
        [off.url, missing.url],
        models={MODEL: {"adapters": {"bad-lora": "/adapters/bad"}}},
        lora_runtime_loading=True,
        eject_after_failures=3,
    )
    async with aiohttp.ClientSession() as http:
        url = gw.url + "/v1/chat/completions"
        for _ in range(8):
            status, _, err = await post(http, url, chat_body("hi", model="bad-lora"))
            assert status == 404, err
            assert err["error"]["code"] == "adapter_unavailable"
            assert "`bad-lora`" in err["error"]["message"]
            assert "/adapters/bad" not in err["error"]["message"]
        status, _, _ = await post(http, url, chat_body("the base model"))
        assert status == 200
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert missing.stats.get("adapter_load_calls", 0) == 1
    fleet_state = gw.gateway.fleet
    assert fleet_state is not None
    assert all(not r.ejected and r.healthy for r in fleet_state.replicas.values())
    assert "prefix_router_replica_ejections_total{" not in metrics
    assert 'outcome="refused"} 2.0' in metrics


async def test_a_request_for_an_adapter_not_loaded_yet_waits_in_the_queue(
    fleet: Any, gateway: Any
) -> None:
    """The fleet's one prefill slot is held; a request for an adapter no replica has loaded
    (runtime loading on) waits in the base model's queue, and is loaded and served once the
    slot frees. Before, no replica served the adapter's name, flow control saw no replica for
    it and let it through at once: it loaded the adapter on the saturated replica."""
    (replica,) = await fleet(1, allow_runtime_lora=True)
    gw = await gateway(
        [replica.url],
        flow_control=True,
        tenant_header="X-Tenant",
        models={MODEL: {"adapters": {"late-lora": "/adapters/late-lora"}}},
        lora_runtime_loading=True,
    )
    async with aiohttp.ClientSession() as http:
        setup = Setup(replica, gw, http)
        await setup.hold()
        task = await setup.enqueue("late", "t", 0, model="late-lora")
        assert setup.queued == 1
        assert replica.stats.get("adapter_load_calls", 0) == 0
        await setup.release()
        status, _, body = await task
    assert status == 200, body
    assert replica.stats["adapter_load_calls"] == 1
