"""Requests and fleets for the scheduling tests: real block hashes, constructed candidates."""

from __future__ import annotations

import random

from router.core.blocks import block_hashes, cacheable_blocks
from router.intake.routed_request import RoutedRequest
from router.schedule import Candidate, Decision


def req(n_tokens: int = 0, first: int = 0, ids: list[int] | None = None) -> RoutedRequest:
    """A routed request of ``n_tokens`` copies of ``first``, or of the given ``ids``."""
    ids = [first] * n_tokens if ids is None else ids
    return RoutedRequest(
        request_id="r",
        endpoint="chat",
        model="m",
        tenant="t",
        body={},
        stream=False,
        token_ids=ids,
        block_size=16,
        block_hashes=block_hashes(ids, 16),
    )


def random_request(rng: random.Random) -> RoutedRequest:
    """A few shared system prompts, then a conversation of random length."""
    system = [rng.randrange(4)] * rng.choice([0, 16, 64, 512])
    tail = [rng.randrange(50_000) for _ in range(rng.randrange(0, 700))]
    return req(ids=system + tail)


def random_fleet(
    rng: random.Random, r: RoutedRequest, urls: list[str], *, index: bool = True
) -> list[Candidate]:
    """Candidates with varied matches (none without ``index``, as the gateway sends
    baselines), loads, queues and KV usage; sometimes one hot replica."""
    limit = cacheable_blocks(r.num_tokens, r.block_size)
    hot = rng.choice(urls) if rng.random() < 0.3 else None
    out = []
    for u in urls:
        matched = rng.choice([0, 0, limit, rng.randint(0, max(limit, 0))]) if index else 0
        inflight = rng.randint(8, 20) if u == hot else rng.randint(0, 4)
        out.append(
            Candidate(
                u,
                matched_blocks=matched,
                inflight=inflight,
                pending_prefill_tokens=rng.randint(0, 3000) * (inflight > 0),
                waiting=rng.randint(0, 3),
                running=inflight,
                kv_usage=rng.random(),
            )
        )
    return out


def essence(d: Decision) -> tuple:
    """What a decision decides, and what explain shows of the others, comparably."""
    return (
        d.replica,
        d.reason,
        d.matched_blocks,
        d.ring_choice,
        tuple((s.url, s.filtered, s.cost) for s in d.scores),
    )
