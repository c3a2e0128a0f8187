"""Offload tiers in precise mode, over real ZMQ sockets and HTTP: vLLM's offloading connector
publishes the blocks it copied to CPU memory with ``medium`` "CPU" (placeholders by default,
self-describing on request); the gateway keeps them, counts the ones right after a replica's
GPU run as reusable (vLLM loads them and reports them in ``cached_tokens``), and scores each
at ``kv_events_offload_weight`` of a GPU block."""

from __future__ import annotations

from typing import Any

import aiohttp

from router.core.blocks import continue_chain, root_hash
from router.index import MemoryIndex
from router.kv_events import Endpoints, KVEventSubscriber
from tests.helpers import post
from tests.test_kv_events import (
    BS,
    KV,
    FakePublisher,
    batch,
    body,
    endpoints,
    settled,
    stored,
)


def placeholder(vh: int) -> dict[str, Any]:
    """vLLM's offloading connector's store event without self_describing_kv_events
    (offloading/events.py, ``_placeholder_stored``)."""
    return {
        "type": "BlockStored",
        "block_hashes": [vh],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": 0,
    }


async def test_offloaded_blocks_are_kept_by_medium_and_extend_the_gpu_match():
    fake = FakePublisher()
    url = "http://replica"
    sub = KVEventSubscriber(
        MemoryIndex(),
        lambda urls: {u: Endpoints(fake.endpoint) for u in urls},
        lambda: [url],
        lambda url: BS,
    )
    await sub.start()
    try:
        await fake.subscribed()
        stream = sub.streams[url]
        tokens = list(range(4 * BS))
        gw = continue_chain(root_hash(), tokens, BS)
        frames = [
            # The GPU computes three blocks; the connector copies each to the CPU.
            batch(stored(tokens[: 3 * BS], None, [1, 2, 3]), *map(placeholder, [1, 2, 3])),
            # The GPU evicts blocks 1 and 2; the CPU evicts block 2 (hash 3).
            batch(
                {"type": "BlockRemoved", "block_hashes": [3, 2], "medium": "GPU", "group_idx": 0},
                {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU", "group_idx": 0},
            ),
        ]
        for seq, payload in enumerate(frames):
            await fake.send(b"", seq.to_bytes(8, "big"), payload)
        await sub.wait(lambda: stream.last_applied == len(frames) - 1)
        assert sub.inner.blocks(url) == {gw[0]}
        assert stream.tiers.sizes() == {"CPU": 2}
        assert sub.index.offloaded(gw, {url: 1}) == {url: 1}  # block 1, then a gap
        seq = len(frames)
        # A self-describing store (parent, tokens): the chain continues from its parent, a
        # block the GPU no longer holds. A root the gateway cannot key (no extra keys: its
        # salt is unknown) is skipped, and so is a placeholder for a hash never seen.
        self_describing = stored(tokens[2 * BS : 4 * BS], 2, [3, 4], medium="CPU")
        unknown_root = stored(tokens[:BS], None, [99], medium="CPU")
        await fake.send(
            b"", seq.to_bytes(8, "big"), batch(self_describing, unknown_root, placeholder(77))
        )
        await sub.wait(lambda: stream.last_applied == seq)
        assert sub.index.offloaded(gw, {url: 1}) == {url: 3}
        assert stream.errors == {"unknown_block": 2}
        assert stream.state()["offloaded_blocks"] == {"CPU": 4}
        # A placeholder on the GPU is malformed; a clear forgets the tier too (vLLM's
        # reset_connector clears it without a word).
        bad = {**placeholder(5), "medium": "GPU"}
        await fake.send(b"", (seq + 1).to_bytes(8, "big"), batch(bad, {"type": "AllBlocksCleared"}))
        await sub.wait(lambda: stream.last_applied == seq + 1)
        assert stream.errors["malformed"] == 1
        assert not stream.tiers and sub.index.offloaded(gw, {url: 0}) == {}
    finally:
        await sub.stop()
        fake.close()


async def test_a_prompt_held_only_on_cpu_goes_back_to_its_replica_scored_as_configured(
    fleet, gateway
):
    """A replica whose GPU evicted a prompt that its CPU tier still holds is predicted to
    load all of it, is scored at the configured weight, and gets the prompt over a cold
    replica; vLLM (the simulator) reports the loaded tokens as cached, as predicted."""
    replicas = await fleet(2, **KV, num_gpu_blocks=64, cpu_offload_blocks=1024)
    weight = 0.5
    gw = await gateway(
        [r.url for r in replicas],
        kv_events=True,
        kv_events_endpoints=endpoints(replicas),
        kv_events_offload_weight=weight,
    )
    sub = gw.gateway.kv_events
    await sub.wait(lambda: all(s.connected and s.up for s in sub.streams.values()))
    prompt = body(0)
    async with aiohttp.ClientSession() as s:
        status, h, _ = await post(s, gw.url + "/v1/chat/completions", prompt)
        assert status == 200
        home = next(r for r in replicas if r.url == h["x-prefix-router-replica"])
        # Other prompts sent straight to it push the first out of its GPU.
        for i in range(1, 6):
            status, _, _ = await post(s, home.url + "/v1/chat/completions", body(i))
            assert status == 200
        await settled(gw, [home])  # the other one published nothing
        assert home.engine.pool.evictions > 0 and home.engine.offload is not None
        status, _, ex = await post(s, gw.url + "/v1/route/explain", prompt)
        assert status == 200, ex
        n = ex["cacheable_blocks"]
        by_url = {c["replica"]: c for c in ex["candidates"]}
        held = by_url[home.url]
        assert held["tiers"] == {"gpu": 0, "offload": n} and held["matched_blocks"] == n
        assert held["weighted_blocks"] == weight * n
        assert held["terms"]["uncached_prefill"] == ex["prompt_tokens"] - round(weight * n * BS)
        assert held["kv_events"]["offloaded_blocks"]["CPU"] >= n
        cold = next(c for u, c in by_url.items() if u != home.url)
        assert cold["matched_blocks"] == 0
        assert cold["terms"]["uncached_prefill"] == ex["prompt_tokens"]
        assert ex["decision"]["replica"] == home.url and ex["decision"]["reason"] == "prefix"
        assert ex["decision"]["predicted_offloaded_blocks"] == n
        # Sent: it goes there, and the replica reports what was predicted.
        status, h, answer = await post(s, gw.url + "/v1/chat/completions", prompt)
        assert status == 200 and h["x-prefix-router-replica"] == home.url
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == int(h["x-prefix-router-cached-blocks"]) * BS == n * BS
