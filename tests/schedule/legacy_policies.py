"""The scheduling policies as they were before the plugin pipeline (router/schedule/policies.py
at 510b7dc), frozen verbatim below this docstring: the oracle ``test_equivalence`` compares the
pipeline's decisions with. Delete it once the pipeline has lived long enough on its own."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from router.core.blocks import cacheable_blocks, pack_tokens
from router.intake.routed_request import RoutedRequest
from router.schedule.ring import HashRing, load_bound


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy replica as the scheduler sees it for one decision."""

    url: str
    matched_blocks: int = 0  # leading blocks the index says it holds
    inflight: int = 0  # requests in flight from all gateways
    pending_prefill_tokens: int = 0  # prompt tokens sent but not yet answered (first byte)
    waiting: int = 0  # scraped vllm:num_requests_waiting
    running: int = 0  # scraped vllm:num_requests_running
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc

    @property
    def load(self) -> int:
        """Requests in flight to the replica from the gateways. The scraped vLLM gauges are
        up to a scrape interval old, and at a few dozen requests a second a stale count
        misdirects more than it informs, so they are shown (explain) but not used here."""
        return self.inflight


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    url: str
    matched_blocks: int
    load: int
    uncached_tokens: int
    queue_tokens: float
    cost: float
    filtered: str | None = None  # why it was not eligible, if it was not


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    matched_blocks: int  # predicted cached blocks on the chosen replica
    reason: str  # prefix | spill | ring | round_robin | random | least_loaded | ...
    policy: str
    scores: tuple[ScoredCandidate, ...] = ()
    ring_choice: str | None = None


class Policy(Protocol):
    name: str
    uses_index: bool

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision: ...

    def placed(self, decision: Decision) -> None:
        """The request was sent as decided (not called for explain)."""
        ...


def tie_key(req: RoutedRequest, held_blocks: int) -> int:
    """The ring key of the first block past ``held_blocks`` (the last block if none is)."""
    if held_blocks and req.block_hashes:
        return req.block_hashes[min(held_blocks, len(req.block_hashes) - 1)]
    return routing_key(req)


def routing_key(req: RoutedRequest) -> int:
    """The ring key: block 0's hash (salted, adapter-keyed), or for a prompt shorter than one
    block a hash of its tokens, so short prompts spread too."""
    if req.block_hashes:
        return req.block_hashes[0]
    return xxhash.xxh3_64_intdigest(pack_tokens(req.token_ids[:256]))


# The share bound applies once the fleet has recently taken this many requests per replica
# (decayed, half-life 10 s: about 1.1 request/s per replica sustained). Below that, a popular
# prefix simply sticks: nothing queues, and spreading it would only cost cache hits.
SHARE_MIN_RECENT = 16


class RecentCounts:
    """Requests routed to each replica, exponentially decayed (half-life ``half_life_s``)."""

    def __init__(
        self, half_life_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._values: dict[str, tuple[float, float]] = {}  # url -> (count, at)

    def _now(self, url: str, now: float) -> float:
        value, at = self._values.get(url, (0.0, now))
        return value * math.exp(-self.rate * (now - at))

    def add(self, url: str) -> None:
        now = self.clock()
        self._values[url] = (self._now(url, now) + 1.0, now)

    def counts(self, urls: Sequence[str]) -> dict[str, float]:
        now = self.clock()
        return {u: self._now(u, now) for u in urls}


class TTFTPolicy:
    """Minimise the estimated time to first token.

    cost(r) = prompt tokens r must prefill (those it does not hold)
            + prompt tokens already queued ahead on r
            + decode_cost x requests running on r.
    A prefix nobody holds goes to its ring owner (bounded loads). No replica takes more than
    ``ceil(c x mean) + 2`` requests while another has room, so a hot prefix spills to a second
    replica instead of pinning the fleet to one, and the spill replica then holds it too.
    """

    name = "ttft"
    uses_index = True

    def __init__(
        self, ring: HashRing, load_bound: float = 1.25, decode_cost_tokens: float = 8.0
    ) -> None:
        self.ring = ring
        self.c = load_bound
        self.decode_cost = decode_cost_tokens
        self.recent = RecentCounts()

    def placed(self, decision: Decision) -> None:
        self.recent.add(decision.replica)

    def _over(self, candidates: Sequence[Candidate]) -> dict[str, str]:
        """Replicas that may not take this request, and why. Two bounds, both ``c x mean``:
        requests in flight now (bursts), and requests routed recently (a popular tenant at
        light load never builds a queue, yet would take most of the fleet's traffic)."""
        urls = [c.url for c in candidates]
        bound = load_bound(self.c, [c.load for c in candidates])
        over = {c.url: "over load bound" for c in candidates if c.load + 1 > bound}
        recent = self.recent.counts(urls)
        total = sum(recent.values())
        if total >= SHARE_MIN_RECENT * len(urls):  # sustained traffic, not a few requests
            share_bound = self.c * (total + 1) / len(urls) + 1
            for url in urls:
                if recent[url] + 1 > share_bound:
                    over.setdefault(url, "over its share of recent requests")
        if len(over) == len(urls):  # everyone is over: the bounds say nothing
            over = {u: why for u, why in over.items() if why == "over load bound"}
            if len(over) == len(urls):
                over = {}
        return over

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        bs = req.block_size
        n = req.num_tokens
        limit = cacheable_blocks(n, bs)
        over = self._over(candidates)

        scores = []
        for c in candidates:
            m = min(c.matched_blocks, limit)
            uncached = n - m * bs
            queue = c.pending_prefill_tokens + self.decode_cost * c.load
            scores.append(
                ScoredCandidate(
                    url=c.url,
                    matched_blocks=m,
                    load=c.load,
                    uncached_tokens=uncached,
                    queue_tokens=queue,
                    cost=uncached + queue,
                    filtered=over.get(c.url),
                )
            )

        best_match = max(s.matched_blocks for s in scores)
        eligible = [s for s in scores if s.filtered is None]
        best_eligible = max(s.matched_blocks for s in eligible)
        # The ring key is the first block the eligible replicas do not all hold: for a fully
        # cold prompt that is block 0; when every replica holds a shared system prompt, it is
        # the first block after it, so conversations behind one system prompt still spread
        # (and land alike on every gateway) instead of all breaking ties the same way.
        key = tie_key(req, best_eligible)
        loads = {c.url: c.load for c in candidates}
        ring_choice = self.ring.pick(key, loads.__getitem__, [s.url for s in eligible], self.c)
        if best_eligible == 0:
            # Cold everywhere it may go: the ring decides, the same on every gateway.
            assert ring_choice is not None
            chosen = next(s for s in scores if s.url == ring_choice)
            reason = "ring" if best_match == 0 else "spill"
        else:
            rank = self.ring.rank(key)
            chosen = min(eligible, key=lambda s: (s.cost, rank.get(s.url, len(rank)), s.url))
            reason = "prefix" if chosen.matched_blocks == best_match else "spill"
        return Decision(
            replica=chosen.url,
            matched_blocks=chosen.matched_blocks,
            reason=reason,
            policy=self.name,
            scores=tuple(scores),
            ring_choice=ring_choice,
        )


class _Stateless:
    def placed(self, decision: Decision) -> None:
        return None


class ConsistentHashPolicy(_Stateless):
    """Baseline: the ring with bounded loads for every request; ignores the index."""

    name = "consistent_hash"
    uses_index = False

    def __init__(self, ring: HashRing, load_bound: float = 1.25) -> None:
        self.ring = ring
        self.c = load_bound

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        loads = {c.url: c.load for c in candidates}
        url = self.ring.pick(routing_key(req), loads.__getitem__, loads, self.c)
        assert url is not None
        return _plain(self.name, url, candidates, ring_choice=url)


class RoundRobinPolicy(_Stateless):
    name = "round_robin"
    uses_index = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.url)
        return _plain(self.name, ordered[next(self._counter) % len(ordered)].url, candidates)


class RandomPolicy(_Stateless):
    name = "random"
    uses_index = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        return _plain(self.name, self._rng.choice(list(candidates)).url, candidates)


class LeastLoadedPolicy(_Stateless):
    """Baseline: fewest requests in flight; ties broken at random (never always the first)."""

    name = "least_loaded"
    uses_index = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        low = min(c.load for c in candidates)
        pick = self._rng.choice([c for c in candidates if c.load == low])
        return _plain(self.name, pick.url, candidates)


def _plain(
    policy: str, url: str, candidates: Sequence[Candidate], ring_choice: str | None = None
) -> Decision:
    chosen = next(c for c in candidates if c.url == url)
    return Decision(
        replica=url,
        matched_blocks=chosen.matched_blocks,
        reason=policy,
        policy=policy,
        ring_choice=ring_choice,
    )


PolicyFactory = Callable[[HashRing, float, float], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "ttft": lambda ring, c, decode: TTFTPolicy(ring, c, decode),
    "consistent_hash": lambda ring, c, decode: ConsistentHashPolicy(ring, c),
    "round_robin": lambda ring, c, decode: RoundRobinPolicy(),
    "random": lambda ring, c, decode: RandomPolicy(),
    "least_loaded": lambda ring, c, decode: LeastLoadedPolicy(),
}


def build_policy(
    name: str, ring: HashRing, load_bound: float = 1.25, decode_cost_tokens: float = 8.0
) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return factory(ring, load_bound, decode_cost_tokens)
