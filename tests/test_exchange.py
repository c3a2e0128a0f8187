"""The exchange (router/routing/exchange.py) drives a routed request's phases through any transport:
one that is not the gateway's HTTP relay (here, in memory) leaves every phase's bookkeeping
as the relay does for the same request on a twin gateway -- in flight and pending prefill
while the replica holds it, flow control's slot, the placement in the index, the prompt
counted, the answer learnt from, everything released -- and a failure before the first byte
or a client that goes away is handled as on the relay path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from router.gateway import Gateway
from router.routing.exchange import Exchange
from router.upstream.proxy import Outcome, UpstreamUnavailable
from router.upstream.transport import Report, Wire
from tests.helpers import chat_body, post, wait_for

REPLICA_HDR = "x-prefix-router-replica"
# The series the phases write: (learning and placement) per replica and policy, the prompt,
# the prediction and what was reported, retries, clients gone.
COUNTED = (
    "prefix_router_requests_total",
    "prefix_router_prompt_tokens_total",
    "prefix_router_predicted_cached_tokens_total",
    "prefix_router_reported_cached_tokens_total",
    "prefix_router_retries_total",
    "prefix_router_client_disconnects_total",
)


class InMemory:
    """A transport that sends nothing: it reports ``sent``, holds the leg until ``go`` (then
    reports its first byte) and again until ``end``, and answers as the simulated replica
    does (or fails, as told)."""

    def __init__(self, fail: int = 0) -> None:
        self.wires: list[Wire] = []
        self.fail = fail  # the first ``fail`` legs are unavailable (an HTTP 503)
        self.holding = asyncio.Event()
        self.go = asyncio.Event()
        self.streaming = asyncio.Event()
        self.end = asyncio.Event()
        self.end.set()  # unless a test holds it mid-answer

    async def send(self, wire: Wire, report: Report) -> tuple[str, Outcome]:
        self.wires.append(wire)
        await report.sent()
        if self.fail:
            self.fail -= 1
            raise UpstreamUnavailable("HTTP 503")
        self.holding.set()
        await self.go.wait()
        report.first_byte()
        self.streaming.set()
        await self.end.wait()
        return "answered", Outcome(200, 0.01, 0, 4, True, b"{}")


def counted(gw: Gateway) -> dict[str, float]:
    """The phases' series of one gateway's metrics page, by name and labels."""
    out = {}
    for line in gw.metrics.exposition().decode().splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith(COUNTED) and float(value):
            out[name] = float(value)
    return out


def load(gw: Gateway) -> dict[str, tuple[int, int, int]]:
    """In flight, pending requests and pending prefill tokens, per replica."""
    assert gw.fleet is not None
    return {
        url: (r.inflight, r.pending_requests, r.pending_prefill_tokens)
        for url, r in gw.fleet.replicas.items()
    }


def slots(gw: Gateway) -> dict[str | None, int]:
    """Flow control's prefill slots held, per replica (any model)."""
    return gw.path.flow.reserved.by_replica()


async def held_blocks(gw: Gateway, body: dict[str, Any]) -> dict[str, int]:
    """How many of ``body``'s blocks the gateway's index places on each replica."""
    assert gw.fleet is not None
    rr = await gw.path.prepare(json.dumps(body).encode(), {}, "chat", "probe", None)
    return await gw.wiring.index.match(rr.block_hashes, list(gw.fleet.replicas))


async def _true(value: bool) -> bool:
    return value


async def _twins(fleet: Any, gateway: Any) -> tuple[Any, Gateway, Gateway]:
    replicas = await fleet(2)
    urls = [r.url for r in replicas]
    relayed = await gateway(urls, eject_after_failures=5, flow_control=True)
    direct = await gateway(urls, eject_after_failures=5, flow_control=True)
    return replicas, relayed, direct.gateway


def _exchange(gw: Gateway, body: dict[str, Any], transport: InMemory) -> asyncio.Task[str]:
    async def run() -> str:
        raw = json.dumps(body).encode()
        rr = await gw.path.prepare(raw, {}, "chat", "in-memory", None, lazy=True, limited=True)
        headers = {"Content-Type": "application/json"}
        return await Exchange(gw.exchanges, rr, {}, headers, transport).run()

    return asyncio.create_task(run())


async def test_each_phase_books_as_the_relay_does(fleet, gateway):
    replicas, relayed, direct = await _twins(fleet, gateway)

    # Answered: the same placement, counts and learning, everything released.
    body = chat_body("the same request on both paths", stream=True)
    transport = InMemory()
    task = _exchange(direct, body, transport)
    await transport.holding.wait()
    wire = transport.wires[0]
    chosen = wire.url.removesuffix("/v1/chat/completions")
    assert load(direct)[chosen][:2] == (1, 1) and slots(direct) == {chosen: 1}
    transport.end.clear()
    transport.go.set()
    await transport.streaming.wait()  # after its first byte: no longer pending, slot free
    assert load(direct)[chosen] == (1, 0, 0) and slots(direct) == {}
    transport.end.set()
    assert await task == "answered"
    assert wire.headers["Content-Type"] == "application/json" and json.loads(wire.body) == body
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, relayed.url + "/v1/chat/completions", body)
    assert status == 200 and headers[REPLICA_HDR] == chosen == wire.extra_headers[REPLICA_HDR]
    for gw in (direct, relayed.gateway):
        assert all(v == (0, 0, 0) for v in load(gw).values()) and slots(gw) == {}
    assert (await held_blocks(direct, body))[chosen] > 0
    assert await held_blocks(direct, body) == await held_blocks(relayed.gateway, body)
    want = counted(relayed.gateway)
    await wait_for(lambda: _true(counted(direct) == want), what="the same learning")

    # Held before its first byte, then its client goes away: in flight, pending prefill,
    # flow control's slot and the placement as on the relay path; then all released.
    body = chat_body("a client that leaves", stream=True)
    transport = InMemory()
    task = _exchange(direct, body, transport)
    await transport.holding.wait()
    chosen = transport.wires[0].url.removesuffix("/v1/chat/completions")
    mid_direct = (load(direct), slots(direct), await held_blocks(direct, body))
    assert load(direct)[chosen][:2] == (1, 1) and slots(direct) == {chosen: 1}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    sim = next(r for r in replicas if r.url == chosen)
    sim.hang_next(1)  # the relay's replica holds it the same way
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(post(s, relayed.url + "/v1/chat/completions", body))
        await wait_for(lambda: _true(sim.hanging == 1), what="the replica holds it")
        gw = relayed.gateway
        mid_relayed = (load(gw), slots(gw), await held_blocks(gw, body))
        held.cancel()
        await wait_for(lambda: _true(load(gw)[chosen][0] == 0), what="released")
    assert mid_direct == mid_relayed
    for gw in (direct, relayed.gateway):
        assert all(v == (0, 0, 0) for v in load(gw).values()) and slots(gw) == {}
    want = counted(relayed.gateway)
    assert want["prefix_router_client_disconnects_total"] == 1
    await wait_for(lambda: _true(counted(direct) == want), what="the same counts")


async def test_a_failure_before_the_first_byte_is_retried_and_its_blocks_taken_back(fleet, gateway):
    replicas, relayed, direct = await _twins(fleet, gateway)
    body = chat_body("a replica fails before its first byte")

    transport = InMemory(fail=1)
    task = _exchange(direct, body, transport)
    await transport.holding.wait()
    first, second = (w.url.removesuffix("/v1/chat/completions") for w in transport.wires)
    assert first != second  # retried on the other replica
    transport.go.set()
    assert await task == "answered"

    next(r for r in replicas if r.url == first).fail_next(1, status=503)
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, relayed.url + "/v1/chat/completions", body)
    assert status == 200 and headers[REPLICA_HDR] == second

    for gw in (direct, relayed.gateway):
        assert all(v == (0, 0, 0) for v in load(gw).values()) and slots(gw) == {}
        held = await held_blocks(gw, body)
        assert held[first] == 0 and held[second] > 0  # taken back from the one that failed
    assert await held_blocks(direct, body) == await held_blocks(relayed.gateway, body)
    want = counted(relayed.gateway)
    assert any(k.startswith("prefix_router_retries_total") for k in want)
    await wait_for(lambda: _true(counted(direct) == want), what="the same counts")
