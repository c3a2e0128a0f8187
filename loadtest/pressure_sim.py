"""A discrete-event simulation of a fleet under the router's real scheduling pipeline.

No HTTP and no asyncio: a virtual clock and a heap of events, so two cores replay minutes of
traffic in seconds. Each replica is a compact vLLM model:

- a prefill FIFO served at ``prefill_tps`` tokens/s (uncached tokens only), one at a time;
- decode after the first token at ``tpot_s`` per output token, all running requests at once;
  its compute shares the replica with prefill (vLLM batches both in one step): each output
  token costs ``decode_cost_tokens`` prefill tokens of the replica's time, taken from the next
  prefill unless the replica sat idle long enough to absorb it;
- the simulated replicas' block pool (``loadtest.sim.kvcache.BlockPool``: vLLM's rules) of
  ``num_blocks`` blocks of ``block_size`` tokens, keyed by ``router.core.blocks`` chained hashes: only
  full blocks are cached; a hit is the longest cached run from block 0, capped at
  ``num_tokens - 1``; blocks of running requests are held; freed blocks join an LRU free queue
  tail-first and allocation evicts from its head; a request's blocks (prompt and output) are
  allocated when its prefill starts, and one whose blocks do not fit waits at the head of the
  FIFO;
- on finish the full blocks of prompt + output (minus the last sampled token) are cached.

The router side is what the gateway does: a ``MemoryIndex`` (capacity = the pool) fed with the
prompt's blocks at placement, ``Candidate``s built like ``Replica.candidate`` (matched blocks,
in flight, pending prefill tokens until the first token; the scraped gauges read live), and the
real pipeline deciding, its decayed history on the virtual clock.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from loadtest.ideal import IdealRequest, ideal_hit_rate
from loadtest.pressure import Conversation
from loadtest.sim.kvcache import Block, BlockPool
from router.core.blocks import block_hashes, cacheable_blocks
from router.index.memory import MemoryIndex
from router.intake.routed_request import RoutedRequest
from router.schedule import Candidate, Decision, HashRing, Pipeline, build_named
from router.schedule.observed import ObservedTTFT, is_wait_sample
from router.schedule.recent import RecentCounts

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never suspends (MemoryIndex's methods) to its result."""
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value  # type: ignore[no-any-return]
    raise RuntimeError("coroutine suspended")


@dataclass(frozen=True)
class FleetParams:
    replicas: int = 8
    num_blocks: int = 1024
    block_size: int = 16
    prefill_tps: float = 1500.0
    tpot_s: float = 0.02
    decode_cost_tokens: float = 4.0  # replica time an output token takes, in prefill tokens
    gateways: int = 1  # gateways sharing the index, each request to one at random
    sync_interval_s: float = 0.5  # how often the gateways exchange their load (fleet mode)


@dataclass
class Req:
    conv: int
    turn: int
    prompt: Sequence[int]
    output: Sequence[int]
    hashes: list[int]  # the prompt's full blocks
    t_send: float = 0.0
    replica: str = ""
    decision: Decision | None = None
    uncached_predicted: int = 0
    hit_blocks: int = 0
    t_first: float = 0.0
    t_end: float = 0.0
    blocks: list[Block] = field(default_factory=list)  # held from admission to the end
    computed: int = 0  # of them, the leading ones holding a hash
    gateway: int = 0  # the gateway that placed it


class Pool:
    """A replica's blocks: ``loadtest.sim.kvcache.BlockPool`` (vLLM's caching and eviction
    rules, the simulated replicas' own) keyed by ``router.core.blocks`` hashes, with a request's
    blocks allocated at admission for its prompt and output."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = BlockPool(num_blocks)

    @property
    def evictions(self) -> int:
        return self.blocks.evictions

    def hit(self, hashes: Sequence[int], limit: int) -> int:
        return len(self.blocks.lookup(hashes, limit))  # type: ignore[arg-type]

    def admit(self, r: Req, block_size: int) -> bool:
        """Take the hit and allocate the rest (prompt + output); False if it does not fit."""
        limit = cacheable_blocks(len(r.prompt), block_size)
        hit = self.blocks.lookup(r.hashes, limit)  # type: ignore[arg-type]
        need = -(-(len(r.prompt) + len(r.output)) // block_size) - len(hit)
        from_free = sum(1 for b in hit if b.ref_cnt == 0)
        if self.blocks.num_free - from_free < need:
            return False
        self.blocks.touch(hit)
        r.blocks = hit + self.blocks.allocate(need)
        r.hit_blocks = r.computed = len(hit)
        return True

    def cache(self, r: Req, hashes: Sequence[int]) -> None:
        """``r``'s next blocks are computed and hold ``hashes``."""
        for h in hashes:
            if r.computed == len(r.blocks):
                return
            self.blocks.cache(r.blocks[r.computed], h)  # type: ignore[arg-type]
            r.computed += 1

    def release(self, r: Req) -> None:
        self.blocks.free(reversed(r.blocks))  # tail first: block 0 ends most recent
        r.blocks = []

    def usage(self) -> float:
        return self.blocks.usage()


class SimReplica:
    def __init__(self, url: str, fp: FleetParams) -> None:
        self.url = url
        self.fp = fp
        self.pool = Pool(fp.num_blocks)
        self.queue: list[Req] = []  # FIFO waiting for prefill
        self.busy_until: float | None = None  # prefill in progress
        self.running = 0
        self.debt = 0.0  # decode work not yet absorbed, in prefill tokens
        self.idle_since = 0.0
        # the gateways' view: each gateway's own counts, and what the last sync published
        self.inflight = [0] * fp.gateways
        self.pending_prefill_tokens = [0] * fp.gateways
        self.synced = [(0, 0)] * fp.gateways
        self.observed: list[ObservedTTFT] = []  # per gateway; the Sim sets their clock
        self.placed = 0
        self.hits = 0
        self.queries = 0

    def sync(self) -> None:
        self.synced = list(zip(self.inflight, self.pending_prefill_tokens, strict=True))

    def candidate(self, matched_blocks: int, gw: int = 0) -> Candidate:
        """As gateway ``gw`` sees the replica: its own counts live, the others' as of the
        last sync (fleet mode's load sync)."""
        others = [v for g, v in enumerate(self.synced) if g != gw]
        return Candidate(
            url=self.url,
            matched_blocks=matched_blocks,
            inflight=self.inflight[gw] + sum(i for i, _ in others),
            pending_prefill_tokens=self.pending_prefill_tokens[gw] + sum(p for _, p in others),
            ttft_s=self.observed[gw].get(),
            waiting=len(self.queue),
            running=self.running,
            kv_usage=self.pool.usage(),
        )


@dataclass
class RunResult:
    policy: str
    reqs: list[Req]
    per_replica: dict[str, int]
    reasons: dict[str, int]
    hits: int
    queries: int
    evictions: int
    ideal_hits: int
    ideal_queries: int
    horizon_s: float


class Sim:
    def __init__(
        self,
        convs: Sequence[Conversation],
        policy: str | Pipeline,
        fp: FleetParams = FleetParams(),
    ) -> None:
        self.fp = fp
        self.now = 0.0
        self.urls = [f"http://sim-{i}:8000" for i in range(fp.replicas)]
        self.replicas = {u: SimReplica(u, fp) for u in self.urls}
        if isinstance(policy, str):
            name = policy
            policy = build_named(name, HashRing(self.urls))
            others = [build_named(name, HashRing(self.urls)) for _ in range(fp.gateways - 1)]
        elif fp.gateways > 1:
            raise ValueError("several gateways need a policy name (one pipeline each)")
        else:
            others = []
        self.policy = policy
        self.gateways = [policy, *others]  # one pipeline each: their own decayed history
        for p in self.gateways:
            p.recent = RecentCounts(clock=lambda: self.now)
        for rep in self.replicas.values():
            rep.observed = [ObservedTTFT(clock=lambda: self.now) for _ in self.gateways]
        self.spread = random.Random(f"gateways-{fp.gateways}")
        self.index = MemoryIndex(fp.num_blocks)
        for u in self.urls:
            run_sync(self.index.set_capacity(u, fp.num_blocks))
        self.convs = convs
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.done: list[Req] = []
        self.reasons: dict[str, int] = {}

    def at(self, t: float, kind: str, obj: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def run(self) -> RunResult:
        for ci, c in enumerate(self.convs):
            self.at(c.start_s, "send", (ci, 0))
        if self.fp.gateways > 1:
            self.at(self.fp.sync_interval_s, "tick", None)
        while self.events:
            self.now, _, kind, obj = heapq.heappop(self.events)
            getattr(self, "_" + kind)(obj)
        return self._result()

    # -- events ------------------------------------------------------------------------------
    def _tick(self, _: None) -> None:
        for rep in self.replicas.values():
            rep.sync()
        if self.events:  # anything left but the ticks
            self.at(self.now + self.fp.sync_interval_s, "tick", None)

    def _send(self, key: tuple[int, int]) -> None:
        ci, k = key
        turn = self.convs[ci].turns[k]
        bs = self.fp.block_size
        r = Req(ci, k, turn.prompt, turn.output, block_hashes(turn.prompt, bs), self.now)
        rr = RoutedRequest(
            request_id=f"{ci}-{k}",
            endpoint="completions",
            model="m",
            tenant="default",
            body={},
            stream=True,
            token_ids=turn.prompt,
            block_size=bs,
            block_hashes=r.hashes,
        )
        r.gateway = g = self.spread.randrange(len(self.gateways)) if len(self.gateways) > 1 else 0
        policy = self.gateways[g]
        matched = (
            run_sync(self.index.match(r.hashes, self.urls))
            if policy.uses_index
            else dict.fromkeys(self.urls, 0)
        )
        cands = [self.replicas[u].candidate(matched[u], g) for u in self.urls]
        d = policy.choose(rr, cands)
        policy.placed(d)
        run_sync(self.index.record(d.replica, r.hashes))
        rep = self.replicas[d.replica]
        r.replica, r.decision = d.replica, d
        r.uncached_predicted = max(0, len(r.prompt) - d.matched_blocks * bs)
        rep.inflight[g] += 1
        rep.pending_prefill_tokens[g] += r.uncached_predicted
        rep.placed += 1
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        rep.queue.append(r)
        self._start_prefill(rep)

    def _start_prefill(self, rep: SimReplica) -> None:
        if rep.busy_until is not None or not rep.queue:
            return
        r = rep.queue[0]
        if not rep.pool.admit(r, self.fp.block_size):
            return  # waits for blocks; retried when a request finishes
        rep.queue.pop(0)
        rep.hits += r.hit_blocks * self.fp.block_size
        rep.queries += len(r.prompt)
        absorbed = (self.now - rep.idle_since) * self.fp.prefill_tps
        work = len(r.prompt) - r.hit_blocks * self.fp.block_size + max(0.0, rep.debt - absorbed)
        rep.debt = 0.0
        rep.busy_until = self.now + work / self.fp.prefill_tps
        self.at(rep.busy_until, "first", r)

    def _first(self, r: Req) -> None:
        rep = self.replicas[r.replica]
        r.t_first = self.now
        if is_wait_sample(True, 200, r.uncached_predicted):  # as RequestPath.learn does
            rep.observed[r.gateway].observe(r.t_first - r.t_send)
        rep.busy_until = None
        rep.idle_since = self.now
        rep.debt += len(r.output) * self.fp.decode_cost_tokens
        rep.pending_prefill_tokens[r.gateway] -= r.uncached_predicted
        rep.pool.cache(r, r.hashes[r.hit_blocks :])
        rep.running += 1
        self.at(self.now + len(r.output) * self.fp.tpot_s, "finish", r)
        self._start_prefill(rep)

    def _finish(self, r: Req) -> None:
        rep = self.replicas[r.replica]
        r.t_end = self.now
        ids = list(r.prompt) + list(r.output)
        bs = self.fp.block_size
        n_out = (len(ids) - 1) // bs
        full = block_hashes(ids, bs, max_blocks=n_out)
        rep.pool.cache(r, full[len(r.hashes) :])
        rep.pool.release(r)
        rep.running -= 1
        rep.inflight[r.gateway] -= 1
        self.done.append(r)
        conv = self.convs[r.conv]
        if r.turn + 1 < len(conv.turns):
            self.at(self.now + conv.turns[r.turn + 1].think_s, "send", (r.conv, r.turn + 1))
        self._start_prefill(rep)

    def _result(self) -> RunResult:
        ideal = ideal_hit_rate(
            [IdealRequest(r.t_send, r.prompt, r.t_end, r.output) for r in self.done],
            self.fp.block_size,
        )
        reps = self.replicas.values()
        return RunResult(
            policy=self.policy.name,
            reqs=self.done,
            per_replica={u: rep.placed for u, rep in self.replicas.items()},
            reasons=dict(self.reasons),
            hits=sum(r.hits for r in reps),
            queries=sum(r.queries for r in reps),
            evictions=sum(r.pool.evictions for r in reps),
            ideal_hits=ideal.hits,
            ideal_queries=ideal.queries,
            horizon_s=self.now,
        )
