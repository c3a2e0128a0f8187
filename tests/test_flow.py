"""Flow control over real sockets: a simulated replica, a gateway with flow control on, and a
request the replica holds (``hang_next``) so that everything after it queues in the gateway.
Releasing the held request (its client leaves) frees the one prefill slot; the replica then
sees the queued requests one at a time, in the order flow control releases them. The tests
read that order from the replica's own records, never from timing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.helpers import chat_body, post, wait_for

MODEL = "Qwen/Qwen3-0.6B"
TENANTS = {
    "a": {"weight": 3},
    "b": {"weight": 1},
    "crit": {"band": "critical"},
    "low": {"band": "sheddable"},
    "impatient": {"queue_timeout_s": 0.05},
    "small": {"max_queue": 1},
}


def body(i: int, **extra: Any) -> dict[str, Any]:
    # the same length everywhere: equal costs, so the order is the weights' and bands'
    return {**chat_body(f"Question number {i % 10}", max_tokens=64), **extra}


class Setup:
    def __init__(self, replica: Any, gw: Any, http: aiohttp.ClientSession) -> None:
        self.replica, self.gw, self.http = replica, gw, http
        self.held: asyncio.Task[Any] | None = None

    @property
    def queued(self) -> int:
        return sum(q.size for q in self.gw.gateway.flow.queues.values())

    async def hold(self) -> None:
        """One request the replica accepts and never answers: the fleet's only slot."""
        self.replica.hang_next(1)
        self.held = asyncio.create_task(self.send("held", "holder", 0))

        async def hanging() -> bool:
            return self.replica.hanging == 1

        await wait_for(hanging, what="the held request at the replica")

    async def release(self) -> None:
        assert self.held is not None
        self.held.cancel()  # its client leaves: the gateway drops the upstream request
        await asyncio.gather(self.held, return_exceptions=True)

    def send(
        self, rid: str, tenant: str, i: int, path: str = "/v1/chat/completions", **extra: Any
    ) -> Awaitable[tuple[int, Any, Any]]:
        headers = {"X-Tenant": tenant, "x-request-id": rid}
        data = body(i, **extra) if path.endswith("completions") else extra["anthropic"]
        return post(self.http, self.gw.url + path, data, headers)

    async def enqueue(self, rid: str, tenant: str, i: int = 0, **extra: Any) -> asyncio.Task[Any]:
        """Send and wait until it is queued, so the queue order is the sending order."""
        before = self.queued
        task = asyncio.create_task(self.send(rid, tenant, i, **extra))

        async def queued() -> bool:
            return self.queued > before or task.done()

        await wait_for(queued, what=f"{rid} queued")
        return task

    def served(self) -> list[str]:
        """Request ids in the order the replica started them (their engine arrival)."""
        records = sorted(self.replica.stats["records"], key=lambda r: r["arrival"])
        ids = [r["request_id"] for r in records if r.get("finish_reason") != "abort"]
        return [i.removeprefix("chatcmpl-") for i in ids]


@pytest.fixture
async def setup(fleet, gateway) -> Any:
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url],
        flow_control=True,
        tenant_header="X-Tenant",
        tenants=TENANTS,
    )
    async with aiohttp.ClientSession() as http:
        yield Setup(replica, gw, http)


async def finish(tasks: list[asyncio.Task[Any]]) -> list[tuple[int, Any, Any]]:
    return list(await asyncio.gather(*tasks))


async def test_weights_decide_the_order_of_release(setup: Setup) -> None:
    await setup.hold()
    tasks = [await setup.enqueue(f"a{i}", "a", i) for i in range(4)]
    tasks += [await setup.enqueue(f"b{i}", "b", i) for i in range(4)]
    await setup.release()
    results = await finish(tasks)
    assert [r[0] for r in results] == [200] * 8
    order = setup.served()
    assert len(order) == 8
    # weight 3 against 1: a, b, then a twice more before b's second turn
    assert [x[0] for x in order[:4]] == ["a", "b", "a", "a"]
    assert setup.gw.gateway.flow.in_prefill(MODEL) == 0


async def test_tenants_under_their_share_go_before_a_busy_tenant_first_come_first_served(
    setup: Setup,
) -> None:
    """x and y used less than busy (x two requests, y one): queued behind busy's backlog,
    they go first, and among themselves in arrival order (not y first for having used
    less): reordering light tenants only moves waiting from one to the other."""
    for rid, tenant, i in (("x0", "x", 0), ("x1", "x", 1), ("y0", "y", 2)):
        status, _, _ = await setup.send(rid, tenant, i)  # the fleet is idle: no queue
        assert status == 200
    await setup.hold()
    work = [await setup.enqueue(f"busy{i}", "busy", i) for i in range(8)]
    await setup.release()
    assert [r[0] for r in await finish(work)] == [200] * 8
    await setup.hold()
    tasks = [await setup.enqueue(f"busy{i}", "busy", i) for i in range(8, 10)]
    for rid, tenant, i in (("x2", "x", 3), ("y1", "y", 4), ("x3", "x", 5), ("y2", "y", 6)):
        tasks.append(await setup.enqueue(rid, tenant, i))
    await setup.release()
    assert [r[0] for r in await finish(tasks)] == [200] * 6
    # plain start-time fair queuing alternated them with busy: x2, y1, busy8, x3, busy9, y2
    assert setup.served()[-6:] == ["x2", "y1", "x3", "y2", "busy8", "busy9"]


async def test_a_prefix_nobody_holds_does_not_take_the_slot_an_earlier_request_waits_for(
    fleet, gateway
) -> None:
    """Two replicas, both busy; x (busy: it used the fleet) waits for the replica holding
    its prefix, then new tenant y's first request (its system prompt cached nowhere, and
    ahead of x in fair order: y used nothing). When x's replica frees, x goes there first:
    y's first, uncached prefill would have held that replica ahead of x, where vLLM's
    queue would have served x first. y takes that replica's next slot."""
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], flow_control=True, tenant_header="X-Tenant")
    async with aiohttp.ClientSession() as http:

        def send(rid: str, tenant: str, i: int) -> Awaitable[tuple[int, Any, Any]]:
            system = f"You answer questions for tenant {tenant}. " * 40  # a prefix per tenant
            return post(
                http,
                gw.url + "/v1/chat/completions",
                chat_body(f"Question number {i}", system=system, max_tokens=64),
                {"X-Tenant": tenant, "x-request-id": rid},
            )

        for i in range(3):  # x's prefix on one replica, and x's usage ahead of y's
            status, headers, _ = await send(f"x{i}", "x", i)
            assert status == 200
        a = next(r for r in replicas if r.url == headers["x-prefix-router-replica"])
        b = next(r for r in replicas if r is not a)
        setup = Setup(a, gw, http)

        async def hold(replica: Any, rid: str, tenant: str) -> asyncio.Task[Any]:
            replica.hang_next(1)
            task = asyncio.create_task(send(rid, tenant, 9))

            async def hanging() -> bool:
                return replica.hanging == 1

            await wait_for(hanging, what=f"{rid} held")
            return task

        held_a = await hold(a, "x-held", "x")  # x's prefix: its replica
        held_b = await hold(b, "h-held", "h")  # a new prefix: the replica still free

        async def enqueue(rid: str, tenant: str, i: int) -> asyncio.Task[Any]:
            before = setup.queued
            task = asyncio.create_task(send(rid, tenant, i))

            async def queued() -> bool:
                return setup.queued > before or task.done()

            await wait_for(queued, what=f"{rid} queued")
            return task

        tasks = [await enqueue("x-late", "x", 4), await enqueue("y-new", "y", 5)]
        held_a.cancel()  # x's replica frees; the other stays busy
        await asyncio.gather(held_a, return_exceptions=True)
        results = await finish(tasks)
        held_b.cancel()
        await asyncio.gather(held_b, return_exceptions=True)
    assert [r[0] for r in results] == [200, 200]
    # before: y-new took the slot (its tenant used less) and x-late waited its prefill out
    assert setup.served()[-2:] == ["x-late", "y-new"]
    assert [r[1]["x-prefix-router-replica"] for r in results] == [a.url, a.url]
    assert gw.gateway.flow.in_prefill(MODEL) == 0


async def test_a_prefix_nobody_holds_takes_its_slot_where_the_scheduler_would_place_it(
    fleet, gateway
) -> None:
    """Three replicas; x sent eight requests lately to the first by name; a request held on
    another keeps the fleet from idle, so new tenant y's first request passes through the
    queue, where flow control picks its slot among the two free replicas. It picks the
    scheduler's choice (the least recent traffic: the third replica), not the first by name
    (x's replica: y's first, uncached prefill beside x's next requests)."""
    replicas = await fleet(3)
    gw = await gateway([r.url for r in replicas], flow_control=True, tenant_header="X-Tenant")
    first = min(r.url for r in replicas)
    async with aiohttp.ClientSession() as http:

        def prompt(tenant: str, i: int = 0) -> dict[str, Any]:
            system = f"You answer questions for tenant {tenant}. " * 40  # a prefix per tenant
            return chat_body(f"Question number {i}", system=system, max_tokens=8)

        def send(rid: str, tenant: str, i: int = 0) -> Awaitable[tuple[int, Any, Any]]:
            headers = {"X-Tenant": tenant, "x-request-id": rid}
            return post(http, gw.url + "/v1/chat/completions", prompt(tenant, i), headers)

        async def find(name: str, wanted: Callable[[dict[str, Any]], bool]) -> tuple[str, str]:
            """A tenant ``name<k>`` whose decision now (explain's) is ``wanted``; its replica."""
            for k in range(60):
                body = prompt(f"{name}{k}")
                _, _, ex = await post(http, gw.url + "/v1/route/explain", body)
                if wanted(ex["decision"]):
                    return f"{name}{k}", ex["decision"]["replica"]
            raise AssertionError(f"no tenant {name}<k> as wanted")

        # x: a tenant whose ring owner is the first replica by name
        x, _ = await find("x", lambda d: d["ring_choice"] == first)
        for i in range(8):
            status, headers, _ = await send(f"{x}-{i}", x, i)
            assert status == 200 and headers["x-prefix-router-replica"] == first

        async def idle() -> bool:
            return all(r.inflight == 0 for r in gw.gateway.fleet.replicas.values())

        await wait_for(idle, what="nothing in flight")
        h, url = await find("h", lambda d: d["replica"] != first)
        held = next(r for r in replicas if r.url == url)
        third = next(r for r in replicas if r.url not in (first, held.url))
        held.hang_next(1)
        task = asyncio.create_task(send("h-held", h))

        async def hanging() -> bool:
            return held.hanging == 1

        await wait_for(hanging, what="h held")
        status, headers, _ = await send("y-new", "y")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert status == 200
    # before: the first free replica by name, x's
    assert headers["x-prefix-router-replica"] == third.url
    assert "y-new" in Setup(third, gw, http).served()
    assert gw.gateway.flow.in_prefill(MODEL) == 0


async def test_a_sessions_past_request_does_not_hold_it_behind_its_tenants_others(
    setup: Setup,
) -> None:
    """x's end user u0 sent a long, uncached prompt (through the queue); later u0, u1 and
    u2 queue one request each, in that order: they go in that order. Charged by cost and
    remembered, u0's went last, behind requests of its tenant that came after it."""
    await setup.hold()
    long = chat_body("Please summarise: " + "the quick brown fox " * 200, max_tokens=64)
    first = asyncio.create_task(
        post(
            setup.http,
            setup.gw.url + "/v1/chat/completions",
            {**long, "user": "u0"},
            {"X-Tenant": "x", "x-request-id": "u0-long"},
        )
    )

    async def queued() -> bool:
        return setup.queued == 1

    await wait_for(queued, what="u0-long queued")
    await setup.release()
    assert (await first)[0] == 200
    await setup.hold()
    tasks = [
        await setup.enqueue("u0-next", "x", 1, user="u0"),
        await setup.enqueue("u1", "x", 2, user="u1"),
        await setup.enqueue("u2", "x", 3, user="u2"),
    ]
    await setup.release()
    assert [r[0] for r in await finish(tasks)] == [200] * 3
    assert setup.served()[-3:] == ["u0-next", "u1", "u2"]


async def test_bands_go_first_whatever_the_arrival(setup: Setup) -> None:
    status, _, idle = await post(
        setup.http, setup.gw.url + "/v1/route/explain", body(0), {"X-Tenant": "b"}
    )
    assert status == 200 and idle["flow"]["verdict"].startswith("passes at once")
    await setup.hold()
    tasks = [
        await setup.enqueue("low0", "low", 0),
        await setup.enqueue("std0", "b", 1),
        await setup.enqueue("crit0", "crit", 2),
        await setup.enqueue("std1", "b", 3),
    ]
    # explain says why a request of b would wait now
    status, _, why = await post(
        setup.http, setup.gw.url + "/v1/route/explain", body(0), {"X-Tenant": "b"}
    )
    assert status == 200
    assert why["flow"]["verdict"].startswith("waits in band standard behind 2 queued")
    assert why["flow"]["capacity"]["saturated"] and why["flow"]["tenant_queued"] == 2
    await setup.release()
    assert [r[0] for r in await finish(tasks)] == [200] * 4
    assert setup.served() == ["crit0", "std0", "std1", "low0"]


async def test_a_deadline_sheds_with_a_429_in_each_apis_shape(setup: Setup) -> None:
    await setup.hold()
    status, headers, err = await setup.send("late", "impatient", 0)
    assert status == 429
    assert err["error"]["code"] == "queue_timeout" and err["error"]["type"] == "RateLimitError"
    assert int(headers["Retry-After"]) >= 1
    anthropic = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}],
    }
    status, headers, err = await setup.send(
        "late2", "impatient", 0, path="/v1/messages", anthropic=anthropic
    )
    assert status == 429
    assert err == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": err["error"]["message"]},
    }
    assert int(headers["Retry-After"]) >= 1
    assert setup.queued == 0
    await setup.release()
    # nothing of the shed requests reached the replica, and the slot is free again
    status, _, _ = await setup.send("after", "b", 0)
    assert status == 200
    assert setup.served() == ["after"]
    assert await shed_count(setup, "impatient", "queue_timeout") == 2


async def test_a_full_tenant_queue_refuses_at_once(setup: Setup) -> None:
    await setup.hold()
    first = await setup.enqueue("s0", "small", 0)
    status, headers, err = await setup.send("s1", "small", 1)
    assert status == 429 and err["error"]["code"] == "queue_full" and "Retry-After" in headers
    other = await setup.enqueue("b0", "b", 2)  # another tenant still queues
    await setup.release()
    assert [r[0] for r in await finish([first, other])] == [200, 200]
    assert setup.served() == ["s0", "b0"]


async def test_a_client_leaving_while_queued_leaves_the_queue(setup: Setup) -> None:
    await setup.hold()
    gone = await setup.enqueue("gone", "a", 0)
    stays = await setup.enqueue("stays", "b", 1)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)

    async def left() -> bool:
        return setup.queued == 1

    await wait_for(left, what="the queue to lose the request whose client left")
    flow = setup.gw.gateway.flow
    assert flow.in_prefill(MODEL) == 1  # only the held request
    await setup.release()
    assert (await stays)[0] == 200
    assert setup.served() == ["stays"]  # the one whose client left never reached the replica
    assert flow.in_prefill(MODEL) == 0 and setup.queued == 0


async def shed_count(setup: Setup, tenant: str, reason: str) -> float:
    async with setup.http.get(setup.gw.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("prefix_router_flow_shed_total{") and (
            f'tenant="{tenant}"' in line and f'reason="{reason}"' in line
        ):
            return float(line.split()[-1])
    return 0.0


async def test_rate_limits_answer_429_with_the_standard_headers(fleet, gateway) -> None:
    (replica,) = await fleet(1)
    gw = await gateway([replica.url], tenant_header="X-Tenant", tenants={"metered": {"rpm": 2}})
    async with aiohttp.ClientSession() as http:
        h = {"X-Tenant": "metered"}
        s1, h1, _ = await post(http, gw.url + "/v1/chat/completions", body(0), h)
        s2, h2, _ = await post(http, gw.url + "/v1/chat/completions", body(1), h)
        s3, h3, err = await post(http, gw.url + "/v1/chat/completions", body(2), h)
        free, hf, _ = await post(http, gw.url + "/v1/chat/completions", body(3))
    assert (s1, s2, s3, free) == (200, 200, 429, 200)
    assert h1["x-ratelimit-limit-requests"] == "2" and h1["x-ratelimit-remaining-requests"] == "1"
    assert h2["x-ratelimit-remaining-requests"] == "0"
    assert err["error"]["code"] == "rate_limit_exceeded" and int(h3["Retry-After"]) >= 1
    assert "x-ratelimit-limit-requests" not in hf  # a tenant without limits


async def two_gateways_on_redis(
    fleet: Any, gateway: Any, redis_server: Any
) -> tuple[Any, Any, Any]:
    """One replica and two gateways with flow control sharing tenants' usage through Redis."""
    (replica,) = await fleet(1)
    common: dict[str, Any] = dict(
        flow_control=True,
        tenant_header="X-Tenant",
        redis_url=redis_server.url,
        sync_interval_s=0.05,
    )
    return replica, await gateway([replica.url], **common), await gateway([replica.url], **common)


async def test_two_gateways_on_one_redis_share_a_tenants_usage(
    fleet, gateway, redis_server
) -> None:
    replica, g1, g2 = await two_gateways_on_redis(fleet, gateway, redis_server)
    async with aiohttp.ClientSession() as http:
        # a works through the first gateway while the fleet has room
        for i in range(4):
            status, _, _ = await post(
                http, g1.url + "/v1/chat/completions", body(i), {"X-Tenant": "a"}
            )
            assert status == 200

        async def shared() -> bool:
            return await remote_usage(http, g2.url, "a") > 0

        await wait_for(shared, what="the second gateway to see a's usage")
        setup = Setup(replica, g2, http)
        replica.stats["records"].clear()
        await setup.hold()
        tasks = [await setup.enqueue("a-late", "a", 5), await setup.enqueue("b-new", "b", 6)]
        await setup.release()
        assert [r[0] for r in await finish(tasks)] == [200, 200]
    # b, idle everywhere, goes before a, which queued first here but worked on the other
    assert setup.served() == ["b-new", "a-late"]


async def test_a_tenant_alone_here_but_not_on_another_gateway_is_served_fairly(
    fleet, gateway, redis_server
) -> None:
    """b is the only tenant the second gateway sees, but a works through the first: the
    tenants contend fleet-wide, so the second gateway's gate is the fair one (b's second
    request waits while its first holds the replica's slot), not a tenant alone's."""
    replica, g1, g2 = await two_gateways_on_redis(fleet, gateway, redis_server)
    async with aiohttp.ClientSession() as http:
        status, _, _ = await post(http, g1.url + "/v1/chat/completions", body(0), {"X-Tenant": "a"})
        assert status == 200

        async def shared() -> bool:
            return await remote_usage(http, g2.url, "a") > 0

        await wait_for(shared, what="the second gateway to see a's usage")
        setup = Setup(replica, g2, http)
        replica.hang_next(1)
        first = asyncio.create_task(setup.send("b0", "b", 0))

        async def hanging() -> bool:
            return replica.hanging == 1

        await wait_for(hanging, what="b's first request at the replica")
        second = await setup.enqueue("b1", "b", 1)
        assert setup.queued == 1 and not second.done()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert (await second)[0] == 200


async def remote_usage(http: aiohttp.ClientSession, url: str, tenant: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("prefix_router_flow_remote_usage_tokens_total{") and (
            f'tenant="{tenant}"' in line
        ):
            return float(line.split()[-1])
    return 0.0


async def test_retry_after_counts_the_callers_own_queue_not_other_tenants(fleet, gateway) -> None:
    """Tenant a is at its bound (3 waiting); its next request gets a 429 with Retry-After
    while tenant b queues 0, 8 and 24 requests. Nothing is released meanwhile (the one slot
    is held), so only b's backlog changes: a's Retry-After stays the same. Before, it was
    computed from every tenant's backlog in the band (3, 11, 27 s): a side channel on b."""
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url], flow_control=True, tenant_header="X-Tenant", tenants={"a": {"max_queue": 3}}
    )
    async with aiohttp.ClientSession() as http:
        setup = Setup(replica, gw, http)
        await setup.hold()
        tasks = [await setup.enqueue(f"a{i}", "a", i) for i in range(3)]
        seen = []
        for total in (0, 8, 24):
            while setup.queued < 3 + total:
                n = setup.queued - 3
                tasks.append(await setup.enqueue(f"b{n}", "b", n))
            status, headers, err = await setup.send("a-over", "a", 9)
            assert status == 429 and err["error"]["code"] == "queue_full"
            seen.append(headers["Retry-After"])
        await setup.release()
        assert {r[0] for r in await finish(tasks)} == {200}
    assert seen[0] == seen[1] == seen[2], seen


async def test_a_tenant_alone_is_released_as_far_as_one_vllm_step_then_fairly(
    setup: Setup,
) -> None:
    """Alone on the fleet, a tenant's requests go to the replica as vLLM's next step would
    take them (three short prompts, far under its step's tokens): nobody waits to be served
    fairly, so nothing waits in the gateway. A second tenant's request makes the gate fair
    again: one request in prefill per replica, the rest queued in fair order."""
    setup.replica.hang_next(4)
    alone = [asyncio.create_task(setup.send(f"a{i}", "a", i)) for i in range(3)]

    async def all_at_replica() -> bool:
        return setup.replica.hanging == 3

    await wait_for(all_at_replica, what="the tenant's three requests at the replica")
    assert setup.queued == 0
    contended = [await setup.enqueue("b0", "b", 0)]
    contended.append(await setup.enqueue("a3", "a", 3))
    assert setup.queued == 2 and setup.replica.hanging == 3
    for task in alone + contended:
        task.cancel()
    await asyncio.gather(*alone, *contended, return_exceptions=True)

    async def nothing_held() -> bool:
        return setup.gw.gateway.flow.in_prefill(MODEL) == 0 and setup.queued == 0

    await wait_for(nothing_held, what="every slot and queue place given back")


async def test_a_tenant_alone_past_its_queue_timeout_goes_to_the_replica_not_a_429(
    setup: Setup,
) -> None:
    """Alone, a tenant whose requests fill a replica's step waits in the gateway; past its
    queue timeout it is sent to vLLM's own queue (which would have kept it waiting), not
    refused: a 429 protects nobody when nobody else is waiting."""
    setup.replica.hang_next(2)
    long_prompt = " ".join(f"word{i}" for i in range(3000))  # over the step's 2048 tokens
    first = asyncio.create_task(
        post(
            setup.http,
            setup.gw.url + "/v1/chat/completions",
            chat_body(long_prompt, max_tokens=8),
            {"X-Tenant": "impatient"},
        )
    )

    def at_replica(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return setup.replica.hanging == n

        return check

    await wait_for(at_replica(1), what="the long prompt at the replica")
    second = await setup.enqueue("i1", "impatient", 1)  # waits: the replica's step is full
    await wait_for(at_replica(2), what="the timed-out request sent on, not refused")
    assert not second.done()
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
