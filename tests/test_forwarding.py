"""The one forwarding path (router/routing/forwarder.py): every endpoint's requests are counted in
flight while a replica holds them and released on every path out, retried elsewhere before
the first byte, and a scheduling plugin sees each attempt's lifecycle (before send, first
byte, done) through the hooks it declares."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import aiohttp

from router.schedule import Decision, registry
from router.schedule.types import Candidate, Cycle, Hook, NoParams, Scorer
from tests.helpers import chat_body, post, wait_for

MODEL = "Qwen/Qwen3-0.6B"
REPLICA_HDR = "x-prefix-router-replica"


async def _true(value: bool) -> bool:
    return value


async def test_tokenize_is_counted_in_flight_released_and_retried(fleet, gateway):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], eject_after_failures=5)
    state = gw.gateway.fleet.replicas
    first = min(replicas, key=lambda r: r.url)  # the least loaded on a tie: by URL
    async with aiohttp.ClientSession() as s:
        first.fail_next(1, status=503)
        status, _, body = await post(s, gw.url + "/tokenize", {"model": MODEL, "prompt": "hi"})
        assert status == 200 and body["count"] >= 1, body
        assert first.stats["injected_failures"] == 1  # it failed first, then the other answered

        first.hang_next(1)
        held = asyncio.create_task(
            post(s, gw.url + "/tokenize", {"model": MODEL, "prompt": "hold me"})
        )
        await wait_for(lambda: _true(first.hanging == 1), what="the replica holds it")
        # Counted while the replica holds it (the old /tokenize path kept no count).
        assert state[first.url].inflight == 1 and state[first.url].pending_requests == 1
        held.cancel()  # the client leaves
        await wait_for(lambda: _true(state[first.url].inflight == 0), what="in flight released")
        assert state[first.url].pending_requests == 0
        assert all(r.pending_prefill_tokens == 0 for r in state.values())


async def test_a_forwarded_get_takes_the_same_path(fleet, gateway):
    """``GET /version`` (no body) is retried, counted and released like any POST."""
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas], eject_after_failures=5)
    state = gw.gateway.fleet.replicas
    first = min(replicas, key=lambda r: r.url)
    async with aiohttp.ClientSession() as s:
        first.fail_next(1, status=503)
        async with s.get(gw.url + "/version") as resp:
            assert resp.status == 200 and "version" in await resp.json()
        assert first.stats["injected_failures"] == 1  # it failed first, then the other answered

        first.hang_next(1)
        held = asyncio.create_task(s.get(gw.url + "/version"))
        await wait_for(lambda: _true(first.hanging == 1), what="the replica holds it")
        assert state[first.url].inflight == 1
        held.cancel()
        await wait_for(lambda: _true(state[first.url].inflight == 0), what="in flight released")
        assert all(r.pending_requests == 0 for r in state.values())


class _Seen:
    events: ClassVar[list[tuple[str, str, Any]]] = []  # (hook, replica, status)


@registry.scorer("test_lifecycle_probe")
class LifecycleProbe(Scorer):
    """A scorer that scores nothing and declares the three lifecycle hooks."""

    Params = NoParams
    name = "test_lifecycle_probe"
    hooks = frozenset({Hook.PLACED, Hook.FIRST_BYTE, Hook.DONE})

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, cycle: Cycle, c: Candidate) -> float:
        return 0.0

    def placed(self, decision: Decision, now: float) -> None:
        _Seen.events.append(("placed", decision.replica, None))

    def first_byte(self, decision: Decision, now: float) -> None:
        _Seen.events.append(("first_byte", decision.replica, None))

    def done(self, decision: Decision, status: int | None, now: float) -> None:
        _Seen.events.append(("done", decision.replica, status))


async def test_a_plugin_sees_every_attempt_once_through_its_lifecycle_hooks(fleet, gateway):
    replicas = await fleet(2)
    # round_robin: each decision the next replica in URL order, whatever the fleet's state
    schedule = {"scorers": ["test_lifecycle_probe"], "picker": "round_robin"}
    gw = await gateway(
        [r.url for r in replicas], schedule=schedule, policy="custom", eject_after_failures=5
    )
    first, second = sorted(r.url for r in replicas)
    _Seen.events.clear()
    async with aiohttp.ClientSession() as s:
        status, h, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("one", stream=True))
        assert status == 200 and h[REPLICA_HDR] == first
        want = [("placed", first, None), ("first_byte", first, None), ("done", first, 200)]
        # A stream's attempt ends once the gateway has written it: maybe after the client read it.
        await wait_for(lambda: _true(len(_Seen.events) >= len(want)), what="the attempt's end")
        assert _Seen.events == want, _Seen.events

        _Seen.events.clear()
        next(r for r in replicas if r.url == second).fail_next(1, status=503)
        status, h, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("two"))
        assert status == 200 and h[REPLICA_HDR] == first  # retried there
        # The failed attempt ends with no answer and no first byte; the retry is a new attempt.
        want = [
            ("placed", second, None),
            ("done", second, None),
            ("placed", first, None),
            ("first_byte", first, None),
            ("done", first, 200),
        ]
        await wait_for(lambda: _true(len(_Seen.events) >= len(want)), what="the attempt's end")
        assert _Seen.events == want, _Seen.events
