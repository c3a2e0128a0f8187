"""Replica faults the active /health check cannot see: a replica that answers 5xx, one that
accepts requests and never answers, one that flaps. Over real sockets to simulated replicas;
the timing of ejections is read from the fleet's own clock and state, or driven with an
injected clock."""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import pytest

from router.fleet.outlier import OutlierPolicy
from router.fleet.replicas import Fleet
from tests.helpers import chat_body, post, wait_for

REPLICA_HDR = "x-prefix-router-replica"
CHAT = "/v1/chat/completions"


async def _metrics(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as resp:
        return await resp.text()


async def test_replica_answering_500_is_ejected_on_its_error_ratio(fleet, gateway):
    replicas = await fleet(3)
    bad = replicas[0]
    # Consecutive-failure ejection out of the way: this is the error-ratio path.
    gw = await gateway([r.url for r in replicas], policy="round_robin", eject_after_failures=10**6)
    # Armed once the gateway's parity probe (its /tokenize calls) is done.
    bad.fail_next(10**9, status=500)  # every request; its /health stays 200
    state = gw.gateway.fleet.replicas[bad.url]
    batch = 6
    statuses: collections.Counter[int] = collections.Counter()
    async with aiohttp.ClientSession() as s:
        for b in range(10):
            results = await asyncio.gather(
                *(post(s, gw.url + CHAT, chat_body(f"q {b}.{i}")) for i in range(batch))
            )
            statuses.update(status for status, _, _ in results)
        after = await asyncio.gather(
            *(post(s, gw.url + CHAT, chat_body(f"after {i}")) for i in range(12))
        )
        await gw.gateway.fleet.check_health()  # /health answers 200 ...
        assert not state.healthy  # ... and cannot end the ejection
        text = await _metrics(s, gw.url)
    assert state.ejected and state.ejection_reason == "error_ratio"
    # The 500s the clients saw: the window's minimum, plus what was in flight at ejection.
    assert 10 <= statuses[500] <= 10 + batch, statuses
    assert statuses[500] == bad.stats["injected_failures"]
    assert {status for status, _, _ in after} == {200}
    assert all(h[REPLICA_HDR] != bad.url for _, h, _ in after)
    line = f'prefix_router_replica_ejections_total{{reason="error_ratio",replica="{bad.url}"}}'
    assert line + " 1.0" in text
    assert gw.gateway.fleet.replicas[bad.url].outlier_state(time.monotonic())["ejected"]


async def test_replica_that_never_answers_is_timed_out_and_ejected(fleet, gateway):
    replicas = await fleet(3)
    hung = replicas[1]
    gw = await gateway(
        [r.url for r in replicas],
        policy="round_robin",
        first_byte_timeout_s=60.0,  # the ceiling: a client waiting this long fails the test
        # Well above factor x what these millisecond answers take, even on a busy host (0.25
        # was passed by 0.35 s with a full suite running beside it): the floor decides.
        first_byte_timeout_floor_s=1.0,
    )
    fl = gw.gateway.fleet
    state = fl.replicas[hung.url]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        # Answered requests teach the gateway how long this fleet takes (milliseconds).
        for i in range(18):
            status, _, _ = await post(s, gw.url + CHAT, chat_body(f"warm {i}", stream=i % 2 == 1))
            assert status == 200
        assert fl.first_byte_timeout(state, False, 4) == 1.0
        assert fl.first_byte_timeout(state, True, None) == 1.0
        assert fl.first_byte_timeout(state, False, None) == 60.0  # unbounded output

        hung.hang_next(10**9)  # accepts, reads nothing, never answers; /health stays 200
        results = await asyncio.gather(
            *(post(s, gw.url + CHAT, chat_body(f"now {i}", stream=i % 2 == 1)) for i in range(12))
        )
        # Every request that waited on it was retried elsewhere, within the derived timeout
        # (the client's own 20 s timeout is far below the 60 s ceiling).
        assert {status for status, _, _ in results} == {200}
        assert all(h[REPLICA_HDR] != hung.url for _, h, _ in results)
        text = await _metrics(s, gw.url)
    assert state.ejected and state.ejection_reason == "consecutive_failures"
    assert _sample(text, f'prefix_router_retries_total{{replica="{hung.url}",why="timeout"}}') >= 3
    # The gateway dropped each connection it gave up on (vLLM would abort the request).
    await wait_for(lambda: _async(hung.hanging == 0), what="hung connections closed")


async def _async(value: bool) -> bool:
    return value


def _sample(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_flapping_503_replica_stays_out_for_growing_intervals(fleet, gateway):
    replicas = await fleet(3)
    bad = replicas[0]
    bad.fail_next(10**9, status=503)  # retried elsewhere; /health stays 200
    gw = await gateway(
        [r.url for r in replicas],
        policy="round_robin",
        ejection_base_s=0.3,
        health_interval_s=0.05,
    )
    state = gw.gateway.fleet.replicas[bad.url]
    seen: list[tuple[float, float]] = []  # (ejected_at, ejected_until), the fleet's clock
    statuses: collections.Counter[int] = collections.Counter()
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while len(seen) < 3:
            assert time.monotonic() < deadline, f"ejections seen: {seen}"
            status, _, _ = await post(s, gw.url + CHAT, chat_body("flap"))
            statuses[status] += 1
            if state.ejected_at is not None and (not seen or seen[-1][0] != state.ejected_at):
                assert state.ejected_until is not None
                seen.append((state.ejected_at, state.ejected_until))
    assert statuses == {200: sum(statuses.values())}  # clients never saw the 503s
    durations = [until - at for at, until in seen]
    assert durations[0] == pytest.approx(0.3)
    assert durations[1] > durations[0] and durations[2] > durations[1]
    assert durations[1] == pytest.approx(0.6) and durations[2] == pytest.approx(0.9)
    # /health answered 200 all along, yet each readmission waited for the ejection's end.
    assert seen[1][0] >= seen[0][1] and seen[2][0] >= seen[1][1]


async def test_last_replica_in_rotation_is_never_ejected(fleet, gateway):
    replicas = await fleet(2)
    for r in replicas:
        r.fail_next(10**9, status=500)
    gw = await gateway([r.url for r in replicas], policy="round_robin", eject_after_failures=10**6)
    async with aiohttp.ClientSession() as s:
        results = [await post(s, gw.url + CHAT, chat_body(f"x {i}")) for i in range(40)]
        async with s.get(gw.url + "/ready") as resp:
            assert resp.status == 200
    # The replicas' own errors reach the clients; nothing is refused for want of a replica.
    assert {status for status, _, _ in results} == {500}
    states = list(gw.gateway.fleet.replicas.values())
    assert sorted(r.ejected for r in states) == [False, True]
    kept = next(r for r in states if not r.ejected)
    assert kept.healthy and kept.window.counts(time.monotonic())[1] >= 10


# -- the fleet's policy, driven with an injected clock -------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_ejection_grows_decays_and_health_cannot_end_it(fleet):
    replicas = await fleet(3)
    clock = Clock()
    policy = OutlierPolicy(base_ejection_s=5.0, max_ejection_s=12.0, decay_s=30.0)
    async with aiohttp.ClientSession() as s:
        f = Fleet([r.url for r in replicas], s, outlier=policy, clock=clock)
        await f.check_health()
        a = f.replicas[replicas[0].url]

        async def eject() -> float:
            for _ in range(3):
                await f.record_failure(a, "HTTP 503")
            assert a.ejected and not a.healthy and a.ejected_at == clock.now
            assert a.ejected_until is not None
            return a.ejected_until - clock.now

        assert await eject() == 5.0
        clock.now += 4.9
        await f.check_health()  # /health answers 200
        assert not a.healthy
        clock.now += 0.1
        await f.check_health()
        assert a.healthy and not a.ejected and a.ejection_reason == "consecutive_failures"
        assert await eject() == 10.0
        clock.now += 10
        await f.check_health()
        assert await eject() == 12.0  # 15, capped
        clock.now += 12
        await f.check_health()
        assert a.healthy and a.ejections == 3
        for left in (2, 1):  # serving cleanly: one ejection forgiven per decay_s
            clock.now += 30
            await f.check_health()
            assert a.ejections == left
        assert await eject() == 10.0


async def test_error_ratio_window_cap_and_client_errors(fleet):
    replicas = await fleet(4)
    clock = Clock()
    policy = OutlierPolicy(consecutive_failures=10**6, max_ejected_percent=50.0)
    async with aiohttp.ClientSession() as s:
        f = Fleet([r.url for r in replicas], s, outlier=policy, clock=clock)
        await f.check_health()
        a, b, c, d = f.replicas.values()
        for _ in range(30):  # the client's fault, never the replica's
            await f.record_response(a, 404)
        assert a.healthy
        for _ in range(9):
            await f.record_response(a, 500)
        clock.now += 11  # those errors leave the window before the ratio is judged
        for _ in range(9):
            await f.record_response(a, 200)
        await f.record_response(a, 500)
        assert a.healthy
        for _ in range(8):  # 9 errors of 18 in the window: not above half
            await f.record_response(a, 500)
        assert a.healthy
        await f.record_response(a, 500)  # 10 of 19
        assert a.ejected and a.ejection_reason == "error_ratio"
        for r in (b, c, d):  # half of four may be out at once
            for _ in range(10):
                await f.record_failure(r, "timeout")
        assert [r.ejected for r in (a, b, c, d)] == [True, True, False, False]
        assert c.healthy and d.healthy

        single = Fleet([replicas[0].url], s, outlier=OutlierPolicy(), clock=clock)
        await single.check_health()
        (only,) = single.replicas.values()
        for _ in range(20):
            await single.record_response(only, 503)
            await single.record_failure(only, "connect: ConnectionRefusedError")
        assert only.healthy and not only.ejected


async def test_first_byte_timeout_follows_observed_answer_times(fleet):
    async with aiohttp.ClientSession() as s:
        f = Fleet(
            ["http://127.0.0.1:9", "http://127.0.0.1:10"],
            s,
            first_byte_timeout_s=60.0,
            first_byte_timeout_floor_s=1.0,
            first_byte_timeout_factor=3.0,
        )
        a, b = f.replicas.values()
        assert f.first_byte_timeout(a, True, None) == 60.0  # nothing known yet
        for _ in range(40):  # steady answers: the estimate's spread decays away
            await f.record_response(a, 200, stream=True, first_byte_s=2.0)
            await f.record_response(a, 200, stream=False, first_byte_s=0.5, completion_tokens=9)
            await f.record_response(a, 500, stream=True, first_byte_s=0.001)  # not learned
        assert f.first_byte_timeout(a, True, None) == pytest.approx(6.0, rel=1e-3)  # 3 x 2 s
        # 0.05 s per token (0.5 s for 10): 3 x 0.05 x (99 + 1)
        assert f.first_byte_timeout(a, False, 99) == pytest.approx(15.0, rel=1e-3)
        assert f.first_byte_timeout(a, False, 4) == 1.0  # the floor
        assert f.first_byte_timeout(a, False, 100_000) == 60.0  # the ceiling
        assert f.first_byte_timeout(a, False, None) == 60.0  # unbounded output
        # b never answered: the fleet's history stands in for its own.
        assert f.first_byte_timeout(b, True, None) == pytest.approx(6.0, rel=1e-3)
