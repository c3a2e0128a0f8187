"""The simulated engine: FCFS scheduling over a finite block pool, on a virtual clock.

Nothing here sleeps or runs a worker task. Every request's future is computed arithmetically
when it is admitted (prefill start = when the replica's single prefill FIFO frees up, first
token after its uncached tokens at ``prefill_tokens_per_s``, then one token every
``1 / decode_tokens_per_s``; with ``decode_cost_tokens``, its decode's share of the replica's
steps, ``max_tokens x decode_cost_tokens`` prefill tokens, occupies the FIFO after its prefill,
absorbed if the FIFO would sit idle anyway), and the few moments at which the block pool changes (a decode
step that needs a new block or fills one, the request finishing) are events on a heap,
processed in virtual-time order whenever anything looks at the engine and by one timer armed
for the earliest event. HTTP handlers only wait on futures and pace their output, so hundreds
of concurrent requests cost little CPU.

Block accounting follows vLLM: at admission a request takes references on its cache hit,
allocates blocks for the rest of its prompt and registers every full prompt block; each decode
step allocates a block when the computed tokens reach a new one and registers blocks as they
fill (``all_token_ids``, so generated tokens are cached too; the last sampled token is never
computed); on finish the blocks are freed tail first. A request is admitted only if the pool
can also hold its whole decode (its blocks are reserved), so a running request never needs
preempting; otherwise it waits, head of line, as vLLM's FCFS scheduler does.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from loadtest.sim.kvcache import Block, BlockPool, extend_hashes
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.offload import CpuTier

WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"

# The engine timer never fires more often than this; events are still applied at their own
# virtual times, only the resolution of futures is coarsened.
_MIN_TIMER_GAP = 0.0005


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Seq:
    """One engine request (one prompt of an HTTP request)."""

    __slots__ = (
        "request_id",
        "prompt_ids",
        "output_ids",
        "all_ids",
        "hashes",
        "lora",
        "cache_salt",
        "meta",
        "state",
        "blocks",
        "reserved",
        "num_registered",
        "num_cached_tokens",
        "arrival",
        "admitted_at",
        "prefill_start",
        "prefill_end",
        "decode_debt_s",
        "first_token_at",
        "finish_at",
        "next_k",
        "num_emitted",
        "admitted",
        "done",
        "finish_reason",
        "end_reason",
        "remote_engine",
        "hold",
        "pulled_blocks",
        "reported_cached",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        output_ids: list[int],
        hashes: list[bytes],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        meta: dict[str, Any] | None = None,
        end_reason: str = "length",
    ) -> None:
        if not prompt_ids or not output_ids:
            raise ValueError("a sequence needs at least one prompt and one output token")
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self.all_ids = prompt_ids + output_ids
        self.hashes = hashes  # full-block hashes of the prompt, extended during decode
        self.lora = lora
        self.cache_salt = cache_salt
        self.meta = meta or {}
        # Why it ends once every output token is out: "length" (the request's token limit),
        # or "stop" (no limit given: the simulated model ends its answer, as at an EOS token).
        self.end_reason = end_reason
        self.state = WAITING
        self.blocks: list[Block] = []
        self.reserved = 0
        self.num_registered = 0  # leading blocks of self.blocks that carry a hash
        self.num_cached_tokens = 0
        self.arrival = self.admitted_at = 0.0
        self.prefill_start = self.prefill_end = math.inf
        self.decode_debt_s = 0.0
        self.first_token_at = self.finish_at = math.inf
        self.next_k = 0
        self.num_emitted = 0
        self.admitted: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] | None = None
        self.finish_reason: str | None = None
        # P/D (loadtest.sim.nixl): a decode leg pulls the prompt blocks it lacks from this
        # prefill engine; a prefill leg keeps its blocks after finishing (``hold``) until the
        # decode leg has read them or the lease ran out.
        self.remote_engine: str | None = None
        self.hold = False
        self.pulled_blocks = 0
        self.reported_cached: int | None = None  # usage's cached_tokens, when not the local hit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def usage_cached(self) -> int:
        """``cached_tokens`` as the answer's usage reports it (a decode leg: the prefill
        replica's count, as vLLM 0.34 reports it)."""
        return self.num_cached_tokens if self.reported_cached is None else self.reported_cached

    @property
    def max_tokens(self) -> int:
        return len(self.output_ids)

    def tokens_due(self, now: float, dt: float) -> int:
        """How many output tokens exist at virtual time ``now``."""
        if now < self.first_token_at:
            return 0
        if dt <= 0:
            return len(self.output_ids)
        return min(len(self.output_ids), int((now - self.first_token_at) / dt + 1e-9) + 1)

    def due_at(self, k: int, dt: float) -> float:
        """Virtual time output token ``k`` (1-based) appears."""
        return self.first_token_at + (k - 1) * dt


class KVTransfer(Protocol):
    """How long a decode engine's pulls take (``loadtest.sim.nixl.Link``)."""

    def pull(self, engine_id: str, num_blocks: int, now: float) -> float:
        """Pull ``num_blocks`` from prefill engine ``engine_id`` starting no earlier than
        ``now``; returns when the blocks are in."""
        ...


class Engine:
    def __init__(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int,
        prefill_tokens_per_s: float,
        decode_tokens_per_s: float,
        request_overhead_s: float,
        max_num_seqs: int,
        instant: bool,
        decode_cost_tokens: float = 0.0,
        metrics: SimMetrics | None = None,
        stats: dict[str, Any] | None = None,
        on_kv_events: Callable[[list[dict[str, Any]]], None] | None = None,
        lora_ids: dict[str, int] | None = None,
        transfer: KVTransfer | None = None,
        cpu_offload_blocks: int = 0,
        cpu_load_cost: float = 0.2,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if prefill_tokens_per_s <= 0 or decode_tokens_per_s <= 0:
            raise ValueError("token rates must be positive")
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks, events=on_kv_events is not None)
        # vLLM's OffloadingConnector to CPU memory (loadtest/sim/offload.py), when sized.
        self.offload = (
            CpuTier(cpu_offload_blocks, events=on_kv_events is not None)
            if cpu_offload_blocks
            else None
        )
        self.cpu_load_cost = cpu_load_cost  # a loaded token's time, in computed tokens
        # KV cache events go out once per engine step, as vLLM's scheduler publishes them.
        self.on_kv_events = on_kv_events
        self.lora_ids = lora_ids or {}
        self.instant = instant
        self.prefill_rate = prefill_tokens_per_s
        self.decode_cost = 0.0 if instant else decode_cost_tokens
        self.dt = 0.0 if instant else 1.0 / decode_tokens_per_s
        self.overhead = 0.0 if instant else request_overhead_s
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self.stats = stats if stats is not None else new_stats()
        self.waiting: deque[Seq] = deque()
        self.active: dict[Seq, None] = {}  # admitted, insertion-ordered
        self.reserved = 0
        self.next_free_at = 0.0  # when the prefill FIFO is free
        self._heap: list[tuple[float, int, Seq, int]] = []
        self._counter = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._last_fire = -math.inf
        self._watchers: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.transfer = transfer  # how long pulling blocks from a prefill engine takes
        self.held: dict[str, Seq] = {}  # finished prefill legs whose blocks wait for D

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop().time()

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its peak (prompt + all computed output tokens)."""
        return cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)

    def _push(self, t: float, seq: Seq, k: int) -> None:
        seq.next_k = k
        heapq.heappush(self._heap, (t, next(self._counter), seq, k))

    # ------------------------------------------------------------------ public

    def submit(self, seqs: list[Seq]) -> None:
        """Requests arrive now (all of them at once, FIFO among themselves)."""
        loop = self._loop()
        now = loop.time()
        self.advance(now)
        for s in seqs:
            s.arrival = now
            s.state = WAITING
            s.admitted = loop.create_future()
            s.done = loop.create_future()
            self.waiting.append(s)
            self.stats["requests"] += 1
        self._try_admit(now)
        self.advance(now)
        self._changed()
        self._publish()

    def abort(self, seq: Seq) -> None:
        """The client went away: stop the request now and free its blocks."""
        if seq.state in (FINISHED, ABORTED):
            return
        now = self.now()
        self.advance(now)
        if seq.state in (FINISHED, ABORTED):
            return
        if seq.state == WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
            seq.num_emitted = 0
        else:
            seq.num_emitted = seq.tokens_due(now, self.dt)
            if now < seq.prefill_start and self.next_free_at == seq.prefill_end + seq.decode_debt_s:
                self.next_free_at = seq.prefill_start  # it was the FIFO's tail: refund
            self._release(seq)
        seq.state = ABORTED
        seq.finish_reason = "abort"
        self.stats["aborted"] += 1
        self.stats["generation_tokens"] += seq.num_emitted
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(seq.num_emitted)
        self._record(seq, now)
        _resolve(seq.admitted)
        _resolve(seq.done)
        self._try_admit(now)
        self.advance(now)
        self._changed()
        self._publish()

    def abort_all(self) -> None:
        for s in [*self.waiting, *self.active]:
            self.abort(s)
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def advance(self, now: float) -> None:
        """Apply every event due by virtual time ``now``."""
        heap = self._heap
        processed = False
        while heap and heap[0][0] <= now:
            t, _, seq, k = heapq.heappop(heap)
            if seq.state != RUNNING or seq.next_k != k:
                continue
            self._step(seq, k, t)
            processed = True
        self._arm_timer()
        if processed:
            self._changed()
        self._publish()

    def reset_cache(self) -> int:
        dropped = self.pool.reset()
        self._publish()
        return dropped

    def _publish(self) -> None:
        if self.on_kv_events is not None:
            events = self.pool.take_events()
            if self.offload is not None:  # the connector's, after the engine's own
                events += self.offload.take_events()
            if events:
                self.on_kv_events(events)

    def counts(self, now: float | None = None) -> tuple[int, int]:
        """(running, waiting) at ``now``: waiting = prefill not started yet."""
        if now is None:
            now = self.now()
        self.advance(now)
        started = sum(1 for s in self.active if s.prefill_start <= now)
        return started, len(self.waiting) + len(self.active) - started

    def lora_counts(self) -> tuple[list[str], list[str]]:
        """(running, waiting) LoRA adapters, as vllm:lora_requests_info labels them."""
        running = sorted({s.lora for s in self.active if s.lora})
        waiting = sorted({s.lora for s in self.waiting if s.lora})
        return running, waiting

    def idle(self) -> bool:
        return not self.waiting and not self.active

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``predicate()`` holds, re-checked after every state change."""
        self.advance(self.now())
        if predicate():
            return
        fut: asyncio.Future[None] = self._loop().create_future()
        entry = (predicate, fut)
        self._watchers.append(entry)
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            if entry in self._watchers:
                self._watchers.remove(entry)

    # ------------------------------------------------------------------ internals

    def _changed(self) -> None:
        if not self._watchers:
            return
        for pred, fut in list(self._watchers):
            if not fut.done():
                try:
                    ok = pred()
                except Exception as exc:  # a broken predicate fails its waiter, not us
                    fut.set_exception(exc)
                    continue
                if ok:
                    fut.set_result(None)

    def _arm_timer(self) -> None:
        if self.instant:
            return
        heap = self._heap
        while heap and (heap[0][2].state != RUNNING or heap[0][2].next_k != heap[0][3]):
            heapq.heappop(heap)  # drop stale entries so the timer is not armed for nothing
        if not heap:
            if self._timer is not None:
                self._timer.cancel()
                self._timer, self._timer_at = None, math.inf
            return
        when = max(heap[0][0], self._last_fire + _MIN_TIMER_GAP)
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop().call_at(when, self._on_timer, when)

    def _on_timer(self, when: float) -> None:
        self._timer, self._timer_at = None, math.inf
        self._last_fire = when
        now = max(self._loop().time(), when)
        self.advance(now)

    def _try_admit(self, t: float) -> None:
        pool, bs = self.pool, self.block_size
        while self.waiting and len(self.active) < self.max_num_seqs:
            s = self.waiting[0]
            p = s.num_prompt_tokens
            # vLLM's skip_reading_prefix_cache (prompt logprobs): computed whole, cached after.
            hit = [] if s.meta.get("skip_cache_read") else pool.lookup(s.hashes, (p - 1) // bs)
            evictable = sum(1 for b in hit if b.ref_cnt == 0)
            total = self.blocks_needed(p, s.max_tokens)
            need_total = total - len(hit)
            if need_total + evictable > pool.num_free - self.reserved:
                break  # head of line waits for blocks, like vLLM's FCFS scheduler
            self.waiting.popleft()
            pool.touch(hit)
            need_now = cdiv(p, bs) - len(hit)
            s.blocks = hit + pool.allocate(need_now)
            s.reserved = need_total - need_now
            self.reserved += s.reserved
            s.num_registered = len(hit)
            loaded = 0  # blocks after the GPU's run loaded from the CPU tier
            if self.offload is not None and not s.meta.get("skip_cache_read"):
                loaded = self.offload.lookup(s.hashes, len(hit), p // bs)
            self._register(s, p // bs)
            cached = len(hit) * bs
            s.num_cached_tokens = cached + loaded * bs
            ready, compute = t, p - cached - loaded * bs
            if self.offload is not None:
                # vLLM's connector counts every request's lookup past the GPU's hit.
                self.offload.store(s.hashes[: p // bs])
                self.stats["offload_tokens"] += loaded * bs
                if self.metrics is not None:
                    self.metrics.external_queries.inc(p - cached)
                    self.metrics.external_hits.inc(loaded * bs)
                if loaded:
                    compute = max(compute, 1)  # the last prompt token, whatever was loaded
                    if not self.instant:
                        ready += loaded * bs * self.cpu_load_cost / self.prefill_rate
            if s.remote_engine is not None and self.transfer is not None and compute > 0:
                # A decode leg: the blocks it lacks come over its link from the prefill
                # engine; it computes only the last prompt token itself (vLLM's scheduler
                # recomputes it to sample the first token).
                s.pulled_blocks = need_now
                ready = self.transfer.pull(s.remote_engine, need_now, t)
                compute = 1
                self.stats["external_tokens"] += p - cached
                self.stats["pulled_blocks"] += need_now
                if self.metrics is not None:
                    self.metrics.external_queries.inc(p - cached)
                    self.metrics.external_hits.inc(p - cached)
            start = max(ready, self.next_free_at)
            end = start if self.instant else start + compute / self.prefill_rate
            s.decode_debt_s = s.max_tokens * self.decode_cost / self.prefill_rate
            self.next_free_at = end + s.decode_debt_s
            s.admitted_at = t
            s.prefill_start, s.prefill_end = start, end
            s.first_token_at = end + self.overhead
            s.finish_at = s.due_at(s.max_tokens, self.dt)
            s.state = RUNNING
            self.active[s] = None
            st = self.stats
            st["queries"] += p
            st["hits"] += cached
            st["prompt_tokens"] += p
            m = self.metrics
            if m is not None:
                m.queries.inc(p)
                m.hits.inc(cached)
                m.prompt_tokens.inc(p)
            self._push(s.first_token_at, s, 1)
            _resolve(s.admitted)

    def _register(self, s: Seq, num_full_blocks: int) -> None:
        """Give hashes to ``s``'s blocks up to ``num_full_blocks`` (vLLM caches a block as soon
        as the tokens scheduled for it fill it)."""
        if s.num_registered >= num_full_blocks:
            return
        extend_hashes(
            s.hashes,
            s.all_ids,
            self.block_size,
            lora=s.lora,
            cache_salt=s.cache_salt,
            upto_blocks=num_full_blocks,
        )
        first = s.num_registered
        for i in range(first, num_full_blocks):
            self.pool.cache(s.blocks[i], s.hashes[i])
        bs = self.block_size
        self.pool.stored(
            s.hashes[first:num_full_blocks],
            s.hashes[first - 1] if first else None,
            s.all_ids[first * bs : num_full_blocks * bs],
            bs,
            first_block=first,
            lora=s.lora,
            lora_id=self.lora_ids.get(s.lora) if s.lora else None,
            cache_salt=s.cache_salt,
        )
        s.num_registered = num_full_blocks

    def _step(self, s: Seq, k: int, t: float) -> None:
        """Output token ``k`` appears at ``t``; unless it is the last one, the engine now
        schedules the decode step that computes it."""
        bs = self.block_size
        p, m = s.num_prompt_tokens, s.max_tokens
        if k == 1 and self.metrics is not None:
            self.metrics.ttft.observe(s.first_token_at - s.arrival)
        if k >= m:
            self._finish(s, t)
            return
        computed = p + k  # tokens with KV after this step
        while len(s.blocks) * bs < computed:
            s.blocks.extend(self.pool.allocate(1))
            s.reserved -= 1
            self.reserved -= 1
        self._register(s, computed // bs)
        nxt = min(m, len(s.blocks) * bs - p + 1, (s.num_registered + 1) * bs - p)
        nxt = max(nxt, k + 1)
        self._push(s.due_at(nxt, self.dt), s, nxt)

    def _release(self, s: Seq) -> None:
        self.pool.free(reversed(s.blocks))
        s.blocks = []
        self.reserved -= s.reserved
        s.reserved = 0
        self.active.pop(s, None)

    def release_held(self, request_id: str) -> bool:
        """A prefill leg's blocks are read (or its lease ran out): free them now. False when
        no finished request holds blocks under that id."""
        s = self.held.pop(request_id, None)
        if s is None:
            return False
        now = self.now()
        self.advance(now)
        self.pool.free(reversed(s.blocks))
        s.blocks = []
        self._try_admit(now)
        self.advance(now)
        self._changed()
        self._publish()
        return True

    def _finish(self, s: Seq, t: float) -> None:
        if s.hold:  # a prefill leg: its blocks stay pinned for the decode leg
            self.reserved -= s.reserved
            s.reserved = 0
            self.active.pop(s, None)
            self.held[s.request_id] = s
        else:
            self._release(s)
        s.state = FINISHED
        s.finish_reason = s.end_reason
        s.num_emitted = s.max_tokens
        st = self.stats
        st["finished"] += 1
        st["generation_tokens"] += s.max_tokens
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(s.max_tokens)
            m.success["length"].inc()
            m.e2e.observe(s.finish_at - s.arrival)
            m.queue_time.observe(s.prefill_start - s.arrival)
            m.prefill_time.observe(s.first_token_at - s.prefill_start)
            m.decode_time.observe(s.finish_at - s.first_token_at)
        self._record(s, t)
        _resolve(s.done)
        self._try_admit(t)

    def _record(self, s: Seq, t: float) -> None:
        admitted = s.state != WAITING and s.prefill_start != math.inf
        self.stats["records"].append(
            {
                "request_id": s.request_id,
                **s.meta,
                "lora": s.lora,
                "cache_salt": s.cache_salt,
                "prompt_tokens": s.num_prompt_tokens,
                "cached_tokens": s.num_cached_tokens,
                "pulled_blocks": s.pulled_blocks,
                "completion_tokens": s.num_emitted,
                "finish_reason": s.finish_reason,
                "arrival": s.arrival,
                "queue_s": (s.prefill_start - s.arrival) if admitted else None,
                "ttft_s": (s.first_token_at - s.arrival) if admitted else None,
                "e2e_s": t - s.arrival,
            }
        )


def new_stats(max_records: int = 100_000) -> dict[str, Any]:
    return {
        "requests": 0,
        "queries": 0,
        "hits": 0,
        "prompt_tokens": 0,
        "generation_tokens": 0,
        "finished": 0,
        "aborted": 0,
        "injected_failures": 0,
        "errors": 0,
        "external_tokens": 0,  # prompt tokens decode legs pulled from prefill replicas
        "offload_tokens": 0,  # prompt tokens loaded from the CPU offload tier
        "pulled_blocks": 0,
        "kv_corrupt_reads": 0,  # pulls of blocks their prefill replica no longer pinned
        "kv_load_failures": 0,  # pulls that failed (prefill side unreachable)
        "kv_leases_expired": 0,  # prefill legs whose blocks no decode leg read in time
        "records": deque(maxlen=max_records),
    }


def _resolve(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)
