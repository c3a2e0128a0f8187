"""Prefill/decode disaggregation through the gateway (router/disagg/), over real sockets to
simulated replicas serving vLLM 0.34's NixlConnector in pull mode: the flow for chat and
completions, the decision to skip the prefill leg, and the failures (a prefill replica
failing, a decode replica failing before its first byte, a prefill replica without a KV
connector); never a corrupt read, never a failed request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from loadtest.replica import SimReplica
from tests.helpers import chat_body, post, wait_for

REPLICA_HDR = "x-prefix-router-replica"
Fleet = Callable[..., Awaitable[list[SimReplica]]]
CHAT = "/v1/chat/completions"
LONG_USER = "Here is the incident report to analyse, line by line. " * 30


def nixl(fleet: Fleet, n: int, **config: Any) -> Awaitable[list[SimReplica]]:
    return fleet(n, kv_connector="NixlConnector", **config)


def legs_seen(sims: list[SimReplica]) -> int:
    return sum(len(s.stats["records"]) for s in sims)


def corrupt(sims: list[SimReplica]) -> int:
    return sum(s.stats["kv_corrupt_reads"] + s.stats["kv_load_failures"] for s in sims)


async def metric(gw: Any, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        page = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


async def test_chat_and_completions_go_through_both_legs(fleet: Fleet, gateway: Any) -> None:
    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    async with aiohttp.ClientSession() as s:
        status, headers, answer = await post(s, gw.url + CHAT, chat_body(LONG_USER))
        assert status == 200, answer
        assert headers[REPLICA_HDR] == d.url  # the client gets the decode leg's answer
        assert headers["x-prefix-router-prefill-replica"] == p.url
        n = answer["usage"]["prompt_tokens"]
        (p_leg,) = p.stats["records"]
        assert p_leg["completion_tokens"] == 1 and p_leg["prompt_tokens"] == n
        assert d.stats["pulled_blocks"] == -(-n // 16)  # D held nothing: every block pulled
        assert answer["choices"][0]["finish_reason"] == "length"
        assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
        # The index holds the prompt's blocks on both: P computed them, D pulled them.
        path = gw.gateway.path
        raw = json.dumps(chat_body(LONG_USER)).encode()
        rr = await path.prepare(raw, {}, "chat", "check")
        held = await gw.gateway.wiring.index.match(rr.block_hashes, [p.url, d.url])
        assert held == {p.url: n // 16, d.url: n // 16}

        # Streamed: the decode replica's stream, relayed.
        body = chat_body(LONG_USER, system="A different assistant. " * 20, stream=True)
        async with s.post(gw.url + CHAT, json=body) as resp:
            assert resp.status == 200
            events = [x for x in (await resp.text()).splitlines() if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(p.stats["records"]) == 2

        # Completions: P's prompt ids come from its choice.
        body = {"model": "Qwen/Qwen3-0.6B", "prompt": LONG_USER + " (completions)", "max_tokens": 3}
        status, headers, answer = await post(s, gw.url + "/v1/completions", body)
        assert status == 200 and headers[REPLICA_HDR] == d.url
        assert len(p.stats["records"]) == 3
    assert corrupt([p, d]) == 0
    assert await metric(gw, 'prefix_router_pd_legs_total{role="prefill"}') == 3
    assert await metric(gw, 'prefix_router_pd_legs_total{role="decode"}') == 3


async def test_the_prefill_leg_is_skipped_when_it_would_not_pay(fleet: Fleet, gateway: Any) -> None:
    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(s, gw.url + CHAT, chat_body("Hi.", system="Be brief."))
        assert status == 200 and legs_seen([p]) == 0  # a short prompt: aggregated on D
        status, _, _ = await post(s, gw.url + CHAT, chat_body(LONG_USER))
        assert status == 200 and legs_seen([p]) == 1
        # The next turn: D holds all but a few tokens (it cached what it pulled).
        status, headers, _ = await post(s, gw.url + CHAT, chat_body(LONG_USER + " And?"))
        assert status == 200 and legs_seen([p]) == 1 and headers[REPLICA_HDR] == d.url
    assert await metric(gw, 'prefix_router_pd_prefill_skipped_total{reason="short_prompt"}') == 1
    skipped = 'prefix_router_pd_prefill_skipped_total{reason="cached_on_decode"}'
    assert await metric(gw, skipped) == 1


async def test_failing_prefill_replicas_fall_back_to_aggregated(fleet: Fleet, gateway: Any) -> None:
    p1, p2, d = await nixl(fleet, 3)
    gw = await gateway([], prefill_replicas=[p1.url, p2.url], decode_replicas=[d.url])
    p1.faults.fail_next(1, 503)
    p2.faults.fail_next(1, 500)
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, gw.url + CHAT, chat_body(LONG_USER))
    assert status == 200 and headers[REPLICA_HDR] == d.url
    assert p1.stats["injected_failures"] == p2.stats["injected_failures"] == 1
    assert d.stats["pulled_blocks"] == 0  # served whole on the decode replica
    assert await metric(gw, 'prefix_router_pd_fallbacks_total{reason="prefill_failed"}') == 2
    reason = 'prefix_router_pd_prefill_skipped_total{reason="no_prefill_replica"}'
    assert await metric(gw, reason) == 1


async def test_a_failed_decode_leg_reruns_its_prefill(fleet: Fleet, gateway: Any) -> None:
    p, d1, d2 = await nixl(fleet, 3)
    sims = {x.url: x for x in (p, d1, d2)}
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d1.url, d2.url])
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, gw.url + CHAT, chat_body(LONG_USER))
        assert status == 200
        warm = sims[headers[REPLICA_HDR]]
        other = d2 if warm is d1 else d1
        warm.faults.fail_next(1, 503)
        # Same prefix, a long new part: decode affinity picks the warm replica, which fails.
        body = chat_body(LONG_USER + " Now the appendix. " + "Another finding to weigh. " * 100)
        status, headers, _ = await post(s, gw.url + CHAT, body)
    assert status == 200 and headers[REPLICA_HDR] == other.url
    assert warm.stats["injected_failures"] == 1
    assert len(p.stats["records"]) == 3  # the prefill leg ran again for the other replica
    assert corrupt([p, d1, d2]) == 0  # the first prefill's params were never re-sent
    assert await metric(gw, 'prefix_router_pd_fallbacks_total{reason="decode_failed"}') == 1


async def test_a_prefill_replica_without_a_kv_connector_is_loud(fleet: Fleet, gateway: Any) -> None:
    (p,) = await fleet(1)  # no --kv-transfer-config: answers kv_transfer_params null
    (d,) = await nixl(fleet, 1)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    async with aiohttp.ClientSession() as s:
        for system in ("One assistant. " * 20, "Another assistant. " * 20):
            body = chat_body(LONG_USER, system=system)
            status, headers, answer = await post(s, gw.url + CHAT, body)
            assert status == 200 and headers[REPLICA_HDR] == d.url, answer
        async with s.get(gw.url + "/ready") as resp:
            ready = json.loads(await resp.text())
    assert d.stats["pulled_blocks"] == 0 and len(d.stats["records"]) == 2
    kind = 'prefix_router_pd_misconfigured_total{kind="no_transfer_params"}'
    assert await metric(gw, kind) == 2
    assert "kv_transfer_params" in ready["disaggregation"][p.url]["no_transfer_params"]


async def test_explain_shows_both_legs_and_why(fleet: Fleet, gateway: Any) -> None:
    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    async with aiohttp.ClientSession() as s:
        _, _, split = await post(s, gw.url + "/v1/route/explain", chat_body(LONG_USER))
        _, _, short = await post(s, gw.url + "/v1/route/explain", chat_body("Hi", system="Hi"))
    legs = split["disaggregation"]["legs"]
    assert [(x["role"], x["replica"]) for x in legs] == [("prefill", p.url), ("decode", d.url)]
    assert split["disaggregation"]["skipped"] is None and legs[1]["prefill_tokens"] == 0
    assert short["disaggregation"]["skipped"] == "short_prompt"
    assert [x["role"] for x in short["disaggregation"]["legs"]] == ["decode"]
    assert legs_seen([p, d]) == 0  # explaining sends nothing


async def test_flow_control_counts_the_prefill_pool(fleet: Fleet, gateway: Any) -> None:
    """A request is admitted before its prefill leg, against the prefill replicas' slots: with
    the one prefill replica busy (another tenant's request: tenants contend), the next request
    waits in the gateway although the decode replica is idle; its decode leg is never queued
    (the prefill slot is free at P's answer)."""
    p, d = await nixl(fleet, 2)
    gw = await gateway(
        [],
        prefill_replicas=[p.url],
        decode_replicas=[d.url],
        flow_control=True,
        tenant_header="X-Tenant",
    )
    p.faults.hang_next(1)
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(post(s, gw.url + CHAT, chat_body(LONG_USER), {"X-Tenant": "a"}))
        await wait_for(lambda: _true(p.faults.hanging == 1), what="the prefill leg held")
        queued = asyncio.create_task(
            post(s, gw.url + CHAT, chat_body(LONG_USER, system="Other. " * 40), {"X-Tenant": "b"})
        )
        flow = gw.gateway.path.flow
        await wait_for(
            lambda: _true(sum(q.size for q in flow.queues.values()) == 1),
            what="the second request queued",
        )
        held.cancel()  # its client leaves: the prefill slot frees, the queued one goes
        status, headers, _ = await queued
    assert status == 200 and "x-prefix-router-queued-ms" in headers
    assert headers[REPLICA_HDR] == d.url and corrupt([p, d]) == 0


async def _true(value: bool) -> bool:
    return value


async def test_messages_and_responses_go_through_both_legs(fleet: Fleet, gateway: Any) -> None:
    """Anthropic Messages and OpenAI Responses split as chat does; a Responses request that
    names a stored response is served whole by the replica whose store holds it (a prefill
    replica would answer 404)."""
    p, d1, d2 = await nixl(fleet, 3)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d1.url, d2.url])
    model = "Qwen/Qwen3-0.6B"
    async with aiohttp.ClientSession() as s:
        body = {"model": model, "max_tokens": 5, "system": "Analyst. " * 10}
        body["messages"] = [{"role": "user", "content": LONG_USER}]
        status, headers, answer = await post(s, gw.url + "/v1/messages", body)
        assert status == 200 and answer["type"] == "message", answer
        assert len(p.stats["records"]) == 1
        body = {"model": model, "input": "Responses: " + LONG_USER, "max_output_tokens": 5}
        status, headers, first = await post(s, gw.url + "/v1/responses", body)
        assert status == 200 and len(p.stats["records"]) == 2, first
        holder = headers[REPLICA_HDR]
        follow = {"model": model, "input": LONG_USER, "previous_response_id": first["id"]}
        status, headers, answer = await post(s, gw.url + "/v1/responses", follow)
    assert status == 200 and headers[REPLICA_HDR] == holder, answer
    assert len(p.stats["records"]) == 2  # no prefill leg: the chain is in the holder's store
    assert sum(x.stats["pulled_blocks"] for x in (d1, d2)) > 0
    assert corrupt([p, d1, d2]) == 0
    reason = 'prefix_router_pd_prefill_skipped_total{reason="stored_response"}'
    assert await metric(gw, reason) == 1


async def test_prefill_first_chooses_the_decode_replica_after_the_prefill_answer(
    fleet: Fleet, gateway: Any
) -> None:
    """pd_order prefill-first: a decode replica that went down while the prefill leg ran is
    not sent the leg (decode-first would send it there, fail, and run the prefill again)."""
    p, d1, d2 = await nixl(fleet, 3)
    sims = {x.url: x for x in (p, d1, d2)}
    urls = [d1.url, d2.url]
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=urls, pd_order="prefill-first")
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, gw.url + CHAT, chat_body(LONG_USER))
        warm = sims[headers[REPLICA_HDR]]
        other = d2 if warm is d1 else d1
        p.faults.hang_next(1)
        body = chat_body(LONG_USER + " Now the appendix. " + "Another finding to weigh. " * 100)
        task = asyncio.create_task(post(s, gw.url + CHAT, body))
        await wait_for(lambda: _true(p.faults.hanging == 1), what="the prefill leg running")
        await warm.stop()
        replica = gw.gateway.fleet.replicas[warm.url]
        await wait_for(lambda: _true(not replica.healthy), what="the gateway sees it down")
        p.faults.release()
        status, headers, _ = await task
    assert status == 200 and headers[REPLICA_HDR] == other.url
    assert len(p.stats["records"]) == 2 and corrupt([p, other]) == 0
    assert await metric(gw, 'prefix_router_pd_fallbacks_total{reason="decode_failed"}') == 0


async def test_a_client_that_sets_kv_transfer_params_drives_the_transfer(
    fleet: Fleet, gateway: Any
) -> None:
    """A client trusted to send kv_transfer_params (auth off, or its tenant's allow_fields)
    gets its request sent as it is, to a decode replica: the gateway does not split it."""
    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    body = chat_body(LONG_USER, kv_transfer_params={"do_remote_prefill": False})
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, gw.url + CHAT, body)
    assert status == 200 and headers[REPLICA_HDR] == d.url and legs_seen([p]) == 0
    reason = 'prefix_router_pd_prefill_skipped_total{reason="client_transfer_params"}'
    assert await metric(gw, reason) == 1


async def test_a_prefill_replica_gone_before_the_pull_is_not_a_failed_request(
    fleet: Fleet, gateway: Any
) -> None:
    """The prefill replica answers, then dies before the decode replica pulls: vLLM's
    decode replica answers 500 (kv_load_failure_policy "fail"), before any byte of the
    answer. The gateway plans again without that prefill replica (here: none left, so the
    decode replica serves the request whole); the client sees a 200."""
    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    d.faults.hang_next(1)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(post(s, gw.url + CHAT, chat_body(LONG_USER)))
        await wait_for(lambda: _true(d.faults.hanging == 1), what="the decode leg held")
        assert len(p.stats["records"]) == 1  # the prefill leg answered
        await p.stop()
        d.faults.release()
        status, headers, _ = await task
    assert status == 200 and headers[REPLICA_HDR] == d.url
    assert d.stats["kv_load_failures"] == 1 and d.stats["kv_corrupt_reads"] == 0
    assert await metric(gw, 'prefix_router_pd_fallbacks_total{reason="pull_failed"}') == 1


async def test_the_load_test_report_shows_the_prefill_legs(
    fleet: Fleet, gateway: Any, tmp_path: Any
) -> None:
    from loadtest import workloads
    from loadtest.report import render_summary
    from loadtest.runner import GatewayTarget, run_workload

    p, d = await nixl(fleet, 2)
    gw = await gateway([], prefill_replicas=[p.url], decode_replicas=[d.url])
    workload = workloads.multi_tenant(
        seed=0,
        tenants=2,
        conversations=3,
        rate=40.0,
        turns=(2, 2),
        think_time_s=0.01,
        system_words=300,
        max_tokens=4,
    )
    res = await run_workload(
        GatewayTarget(gw.url, [p.url, d.url]),
        workload,
        concurrency=2,
        max_seconds=30,
        request_timeout_s=10,
        progress=False,
        compute_ideal=False,
    )
    split = [r for r in res.records if r.prefill_replica == p.url]
    assert res.ok == res.sent and split and len(split) == len(p.stats["records"])
    summary = render_summary([res], command="test")
    assert "## Prefill/decode disaggregation" in summary
    assert f"| {res.label} | {len(split)} (" in summary
