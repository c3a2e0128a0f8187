"""Fleet mode on a Redis Cluster (3 masters, 3 replicas) and behind a Redis Sentinel: real
redis-server processes (tests/redis_ha.py), simulated replicas, in-process gateways.

Three models whose hash tags fall on the three masters; every key a script or pipeline of the
gateway touches carries one tag, so each call stays in one slot. A master killed mid-load
costs hit rate for a moment, never a request: the gateways answer from their local view
until the replica is promoted, then pick it up by themselves.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import aiohttp
import pytest
import redis

from loadtest.replica import SimConfig, SimReplica
from router.config import ConfigError, load_config
from router.core.bundled import tokenizer_dir
from router.http.app import RunningGateway, start_gateway
from router.http.startup import summary
from router.ops.admin import SERVED_EXTENSIONS
from tests.helpers import LONG_SYSTEM, cached_tokens, post, wait_for
from tests.redis_ha import (  # noqa: F401  (fixtures)
    LocalCluster,
    LocalSentinel,
    redis_cluster_fixture,
    redis_sentinel_fixture,
)

# {model-a}, {model-b}, {model-c} hash to slots 5233, 9234, 13363: masters 0, 1 and 2.
MODELS = ["model-a", "model-b", "model-c"]
QWEN = "Qwen/Qwen3-0.6B"  # the conftest fixtures' model
PREFIX = "ha-test"
CHAT = "/v1/chat/completions"
BLOCK = 16


@pytest.fixture
async def replicas() -> Any:
    """Two simulated replicas per model (the Qwen tokenizer under each name)."""
    started: dict[str, list[SimReplica]] = {}
    try:
        for model in MODELS:
            for _ in range(2):
                r = SimReplica(SimConfig(model=model, tokenizer=str(tokenizer_dir())))
                await r.start()
                started.setdefault(model, []).append(r)
        yield started
    finally:
        for rs in started.values():
            for r in rs:
                await r.stop()


async def gateway(urls: list[str], **overrides: Any) -> RunningGateway:
    overrides.setdefault("health_interval_s", 0.2)
    overrides.setdefault("metrics_interval_s", 60)  # no load scrapes mid-test
    if overrides.get("redis_url"):
        overrides.setdefault("redis_prefix", PREFIX)
        overrides.setdefault("sync_interval_s", 0.1)
        overrides.setdefault("redis_timeout_ms", 250.0)
    models = {m: {"tokenizer": str(tokenizer_dir())} for m in MODELS}
    config = load_config(None, env={}, replicas=sorted(urls), models=models, **overrides)
    return await start_gateway(config, port=0, extensions=SERVED_EXTENSIONS)


def body(model: str, team: int, user: str) -> dict[str, Any]:
    system = f"Team {team} of {model}. " + LONG_SYSTEM
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def workload() -> list[dict[str, Any]]:
    """15 requests (under the share-of-recent bound's minimum): teams, repeats, new turns."""
    return [
        body(m, team, user)
        for m in MODELS
        for team, user in ((0, "q1"), (1, "q1"), (0, "q2"), (0, "q1"), (1, "q3"))
    ]


async def quiet(gws: list[RunningGateway]) -> None:
    """No Redis write pending and no gateway seeing load from a finished request."""

    async def idle() -> bool:
        return not any(
            g.gateway._background
            or getattr(getattr(g.gateway.index, "primary", None), "pending", 0)
            for g in gws
        ) and not any(r.remote_inflight for g in gws for r in g.gateway.fleet.replicas.values())

    await wait_for(idle, what="pending writes and remote load to clear")
    if len(gws) > 1:
        marks = [g.gateway.sync.ticks for g in gws]

        async def ticked() -> bool:  # each has published idle and read the others since
            return all(g.gateway.sync.ticks >= m + 2 for g, m in zip(gws, marks, strict=True))

        await wait_for(ticked, what="a full sync tick on every gateway")
        await wait_for(idle, what="remote load to clear")


async def sharing(gws: list[RunningGateway]) -> None:
    """Every gateway reads the others' entries (load and health shared through Redis)."""

    async def peers() -> bool:
        return all(
            g.gateway.sync.redis_up and len(g.gateway.sync.peers) == len(gws) - 1 for g in gws
        )

    await wait_for(peers, what="the gateways to see each other")


async def run(gws: list[RunningGateway], reqs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Send ``reqs`` one at a time through the gateways in turn: (replica, predicted tokens),
    checking that each prediction is what the replica then reports cached."""
    out = []
    async with aiohttp.ClientSession() as s:
        for i, b in enumerate(reqs):
            await quiet(gws)
            status, h, answer = await post(s, gws[i % len(gws)].url + CHAT, b)
            assert status == 200, answer
            predicted = int(h["x-prefix-router-cached-blocks"]) * BLOCK
            assert cached_tokens(answer) == predicted, (i, b["model"])
            out.append((h["x-prefix-router-replica"], predicted))
    return out


def cluster_keys(cluster: LocalCluster) -> dict[int, list[str]]:
    """Every key of the cluster, by the index of the master holding it."""
    out = {}
    for i, m in enumerate(cluster.masters):
        with redis.Redis(port=m.port, decode_responses=True) as c:
            out[i] = list(c.keys("*"))
    return out


async def test_two_gateways_on_a_cluster_route_every_model_as_one_gateway_does(
    redis_cluster: LocalCluster, replicas: dict[str, list[SimReplica]]
) -> None:
    urls = [r.url for rs in replicas.values() for r in rs]
    reqs = workload()
    # The reference: one gateway with its own prefix map.
    alone = await gateway(urls)
    try:
        expected = await run([alone], reqs)
    finally:
        await alone.stop()
    for rs in replicas.values():
        for r in rs:
            r.reset_cache()

    gws = [await gateway(urls, redis_url=redis_cluster.url) for _ in range(2)]
    try:
        assert "Redis Cluster, 3 seed node(s)" in "\n".join(summary(gws[0].gateway, gws[0].url))
        await sharing(gws)
        got = await run(gws, reqs)
        assert got == expected
        assert sum(p > 0 for _, p in got) >= 9  # the workload does share prefixes
        for g in gws:
            assert g.gateway.index.fallbacks == 0 and g.gateway.index.redis_up
        # Each model's keys in one slot, the three models on the three masters; what is
        # shared about the whole fleet under its own tag.
        held = cluster_keys(redis_cluster)
    finally:
        for g in gws:
            await g.stop()
    for i, model in enumerate(MODELS):
        keys = [k for k in held[i] if "{" + model + "}" in k]
        assert {k.split(":")[2] for k in keys} >= {"blocks", "map"}, held
        assert len({redis_cluster.keyslot(k) for k in keys}) == 1
    every = [k for keys in held.values() for k in keys]
    fleet = [k for k in every if "{fleet}" in k]
    assert fleet and len({redis_cluster.keyslot(k) for k in fleet}) == 1
    tagged = {k for k in every if any("{" + m + "}" in k for m in MODELS)}
    assert set(every) == tagged | set(fleet), every  # no key outside the tags


async def failover_under_load(
    gws: list[RunningGateway], models: list[str], kill: Any, promoted: Any
) -> None:
    """Requests through both gateways in turn while ``kill()`` takes a master down: none
    fails, and hit/ideal (cached tokens reported over the shared system prompt's, for
    teams already seen) is back within 0.02 of before within 10 s, on the shared index."""
    statuses: collections.Counter[int] = collections.Counter()
    # (hit, ideal) per finished request, in order
    done: list[tuple[int, int]] = []
    seen: set[tuple[str, int]] = set()
    shared = {}
    stop = asyncio.Event()
    g0 = gws[0].gateway
    for m in models:
        rr = await g0.path.prepare(json.dumps(body(m, 0, "")).encode(), {}, "chat", "t")
        shared[m] = (len(rr.block_hashes) - 1) * BLOCK  # the system prompt's full blocks

    async def worker(s: aiohttp.ClientSession, w: int) -> None:
        i = 0
        while not stop.is_set():
            model, team = models[(w + i) % len(models)], (w + i) % 4
            status, _, answer = await post(
                s, gws[(w + i) % len(gws)].url + CHAT, body(model, team, f"w{w} q{i}")
            )
            statuses[status] += 1
            if status == 200:
                first = (model, team) not in seen
                seen.add((model, team))
                if not first:
                    done.append((cached_tokens(answer), shared[model]))
            i += 1

    def ratio(window: list[tuple[int, int]]) -> float:
        return min(1.0, sum(min(h, i) for h, i in window) / max(1, sum(i for _, i in window)))

    async def count(n: int) -> int:
        target = len(done) + n

        async def reached() -> bool:
            return len(done) >= target

        await wait_for(reached, timeout=30.0, what=f"{n} more requests")
        return target

    async with aiohttp.ClientSession() as s:
        workers = [asyncio.create_task(worker(s, w)) for w in range(4)]
        try:
            await count(30)
            end = await count(20)
            before = ratio(done[end - 20 : end])
            killed_at = time.monotonic()
            mark = len(done)
            await asyncio.to_thread(kill)

            async def recovered() -> bool:
                if not all(g.gateway.index.redis_up for g in gws) or len(done) < mark + 20:
                    return False
                return ratio(done[-20:]) >= before - 0.02

            await wait_for(recovered, timeout=10.0, what="hit/ideal back after the failover")
            recovered_in = time.monotonic() - killed_at
            print(f"hit/ideal {before:.3f} before, back in {recovered_in:.1f}s")
            await asyncio.to_thread(promoted)
            await sharing(gws)
            await count(10)
        finally:
            stop.set()
            await asyncio.gather(*workers)
    assert set(statuses) == {200}, statuses

    async def all_up() -> bool:  # a late timeout may have re-opened a circuit: let it close
        return all(g.gateway.index.redis_up for g in gws)

    await wait_for(all_up, timeout=30.0, what="the shared index up on every gateway")
    # the kill was felt (a gateway answered from its local view) and is over
    assert sum(g.gateway.index.transitions for g in gws) >= 2
    assert all(g.gateway.index.transitions % 2 == 0 for g in gws)
    assert before >= 0.9, before
    assert recovered_in <= 10.0
    # The shared index works on the new master: a prefix learned via gateway 0 only is
    # predicted by gateway 1 from Redis.
    g1 = gws[1].gateway
    async with aiohttp.ClientSession() as s:
        for m in models:
            b = body(m, 9, "first")
            status, h, _ = await post(s, gws[0].url + CHAT, b)
            assert status == 200
            rr = await g1.path.prepare(json.dumps(b).encode(), {}, "chat", "t")
            hashes = list(rr.block_hashes)

            async def in_redis(owner: str = h["x-prefix-router-replica"], hs: Any = hashes) -> bool:
                got = await g1.index.primary.match(hs, list(g1.fleet.replicas))
                return bool(got[owner] == len(hs))

            await wait_for(in_redis, what=f"gateway 0's record of {m} in the new master")


async def ha_gateways(gateway: Any, fleet: Any, redis_url: str) -> list[RunningGateway]:
    replicas = await fleet(3)
    urls = [r.url for r in replicas]
    return [
        await gateway(
            urls,
            redis_url=redis_url,
            redis_prefix=PREFIX,
            sync_interval_s=0.1,
            redis_timeout_ms=250.0,
            metrics_interval_s=60,
        )
        for _ in range(2)
    ]


async def test_a_cluster_master_killed_mid_load_loses_no_request(
    redis_cluster: LocalCluster, gateway: Any, fleet: Any
) -> None:
    gws = await ha_gateways(gateway, fleet, redis_cluster.url)
    await sharing(gws)
    # Kill the master holding the model's index (the fleet's keys live on another one).
    at = redis_cluster.owner_of(redis_cluster.keyslot("{" + QWEN + "}"))
    assert at != redis_cluster.owner_of(redis_cluster.keyslot("{fleet}"))
    await failover_under_load(
        gws, [QWEN], redis_cluster.masters[at].kill, lambda: redis_cluster.wait_promoted(at)
    )


async def test_a_sentinel_master_killed_mid_load_loses_no_request(
    redis_sentinel: LocalSentinel, gateway: Any, fleet: Any
) -> None:
    gws = await ha_gateways(gateway, fleet, redis_sentinel.url)
    line = "\n".join(summary(gws[0].gateway, gws[0].url))
    assert "Redis Sentinel master 'prefix-router-master' via 1 sentinel(s)" in line
    await sharing(gws)
    await failover_under_load(gws, [QWEN], redis_sentinel.master.kill, redis_sentinel.wait_promoted)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://", "no host:port"),
        ("redis+cluster://10.0.0.1:6379,10.0.0.2:x", "bad port in '10.0.0.2:x'"),
        ("redis+cluster://10.0.0.1:6379/3", "a cluster has only database 0"),
        ("redis+sentinel://10.0.0.1:26379", "/MASTER_NAME[/db]"),
        ("redis+sentinel://10.0.0.1:26379/mymaster/x", "/MASTER_NAME[/db]"),
        ("redis+sentinel://u:secret@10.0.0.1/m?ssl=1", "take no query options"),
        ("sentinel://10.0.0.1:26379/mymaster", "redis_url must start with redis://"),
    ],
)
def test_a_malformed_redis_url_is_a_one_line_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, replicas=["http://127.0.0.1:1"], redis_url=url)
    assert len(err.value.problems) == 1
    line = err.value.problems[0]
    assert "\n" not in line and says in line and "secret" not in line, line


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
        "rediss+cluster://user:pw@[::1]:7000/",
        "redis+sentinel://10.0.0.1,10.0.0.2:26380/mymaster/2",
    ],
)
def test_cluster_and_sentinel_urls_are_accepted(url: str) -> None:
    assert load_config(None, env={}, replicas=["http://127.0.0.1:1"], redis_url=url)
