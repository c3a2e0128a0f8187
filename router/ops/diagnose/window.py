"""The bounded sliding window behind every report, and :func:`analyze`, its unbounded use
over a sequence of samples."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from router.core.blocks import block_hashes as chain_hashes
from router.core.blocks import cacheable_blocks
from router.ops.diagnose.analysis import (
    ANCHOR_TOKENS,
    CONTEXT_TOKENS,
    DecodeFor,
    Group,
    GroupKey,
    Pair,
    Record,
    Sample,
    Seen,
    find_resync,
    first_divergence,
    held_blocks,
    pack_slice,
)
from router.ops.diagnose.report import build_report


class Window:
    """The incremental engine behind the report: a bounded sliding window of records.

    ``add`` computes, at arrival, everything the report sums later: the ideal match (against
    every earlier request still in the window), the replayed placement match, the divergence
    from the group's previous request. A report only sums and decodes."""

    def __init__(
        self,
        *,
        max_requests: int = 4096,
        max_age_s: float = 900.0,
        max_blocks: int = 65_536,
        pairs_per_group: int = 256,
        max_groups: int = 256,
        max_held_tokens: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_requests = max_requests
        self.max_age_s = max_age_s
        self.max_blocks = max_blocks
        self.pairs_per_group = pairs_per_group
        self.max_groups = max_groups
        self.max_held_tokens = max_held_tokens
        self.clock = clock
        self.records: deque[Record] = deque()
        self.groups: OrderedDict[GroupKey, Group] = OrderedDict()
        self._seq = 0
        self._oldest = 0  # sequence number of the oldest live record
        self._blocks = 0  # prompt blocks of the live records
        self._generation = 0  # blocks inserted since the last rotation
        self._held = 0  # token ids held as the groups' previous requests
        self._ideal: dict[str, Seen] = {}  # per model: one unlimited cache
        self._placed: dict[tuple[str, str], Seen] = {}  # per (model, replica): the replay
        self.block_size: int | None = None
        self.reporting_replicas: set[str] = set()  # replicas seen reporting cached_tokens
        # model -> [n, ideal, placed_n, available, captured, delivered_n, delivered]
        self.sums: dict[str, list[int]] = {}

    # -- ingest -----------------------------------------------------------------------------
    def add(self, s: Sample, now: float | None = None) -> Record:
        now = self.clock() if now is None else now
        t = now if s.t is None else s.t
        bs = s.block_size
        self.block_size = bs
        ids = s.token_ids if isinstance(s.token_ids, list) else list(s.token_ids)
        n = len(ids)
        hashes = (
            s.block_hashes
            if s.block_hashes is not None
            else chain_hashes(ids, bs, cache_salt=s.cache_salt, lora=s.lora)
        )
        nb = len(hashes)
        limit = min(cacheable_blocks(n, bs), nb)
        self._expire(t, incoming_blocks=nb)
        if self._generation + nb > self.max_blocks:
            self._rotate()
        self._generation += nb
        seq = self._seq
        self._seq += 1
        oldest = self._oldest
        ideal_seen = self._ideal.get(s.model)
        if ideal_seen is None:
            ideal_seen = self._ideal[s.model] = Seen()
        ideal = held_blocks(hashes, limit, ideal_seen, oldest) * bs
        ideal_seen.add(hashes, seq)
        replayed = None
        if s.replica is not None:
            placed = self._placed.get((s.model, s.replica))
            if placed is None:
                placed = self._placed[(s.model, s.replica)] = Seen()
            replayed = held_blocks(hashes, limit, placed, oldest) * bs
            placed.add(hashes, seq)
        self._blocks += nb

        delivered = s.cached_tokens
        if s.replica is not None:
            if delivered is not None:
                self.reporting_replicas.add(s.replica)
            elif s.replica in self.reporting_replicas:
                delivered = 0  # vLLM omits prompt_tokens_details on a miss
        key: GroupKey = (s.model, s.tenant, s.app)
        rec = Record(
            seq,
            t,
            key,
            n,
            nb,
            ideal,
            s.replica,
            replayed,
            s.captured_tokens,
            s.available_tokens,
            delivered,
            s.completion_tokens,
            s.max_tokens,
        )
        self.records.append(rec)
        self._sum(rec, +1)
        self._diverge(key, s, ids, hashes, t)
        return rec

    def _sum(self, r: Record, sign: int) -> None:
        acc = self.sums.setdefault(r.key[0], [0, 0, 0, 0, 0, 0, 0])
        acc[0] += sign * r.n
        acc[1] += sign * r.ideal
        if r.captured is not None:
            acc[2] += sign * r.n
            acc[3] += sign * min(r.available if r.available is not None else r.captured, r.n)
            acc[4] += sign * r.captured
        if r.delivered is not None:
            acc[5] += sign * r.n
            acc[6] += sign * min(r.delivered, r.n)

    def _expire(self, now: float, incoming_blocks: int = 0) -> None:
        recs = self.records
        horizon = now - self.max_age_s
        while recs and (
            len(recs) >= self.max_requests
            or recs[0].t < horizon
            or self._blocks + incoming_blocks > self.max_blocks
        ):
            r = recs.popleft()
            self._blocks -= r.blocks
            self._sum(r, -1)
        self._oldest = recs[0].seq if recs else self._seq

    def _rotate(self) -> None:
        """Every live record was inserted in the last ``max_blocks`` blocks, so in the current
        or the previous generation: the one before can go."""
        self._generation = 0
        for model in [m for m, seen in self._ideal.items() if not seen.rotate()]:
            del self._ideal[model]
        for rk in [k for k, seen in self._placed.items() if not seen.rotate()]:
            del self._placed[rk]

    def _diverge(
        self, key: GroupKey, s: Sample, ids: list[int], hashes: Sequence[int], t: float
    ) -> None:
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(deque(maxlen=self.pairs_per_group))
            while len(self.groups) > self.max_groups:
                _, gone = self.groups.popitem(last=False)
                self._held -= len(gone.last_ids or ())
        else:
            self.groups.move_to_end(key)
        n = len(ids)
        prev = group.last_ids
        if prev is not None:
            same_key = group.last_key == (s.cache_salt, s.lora)
            d = first_divergence(
                prev,
                ids,
                a_hashes=group.last_hashes if same_key else None,
                b_hashes=hashes if same_key else None,
                block_size=s.block_size,
            )
            shorter = min(len(prev), n)
            c = CONTEXT_TOKENS
            pair = Pair(
                t=t,
                index=d,
                prev_len=len(prev),
                cur_len=n,
                extends=d >= shorter,
                before=pack_slice(ids, d - c, d),
                after_prev=pack_slice(prev, d, d + c),
                after_cur=pack_slice(ids, d, d + c),
                model=key[0],
            )
            pair.key_differs = not same_key
            pt, ct = group.last_tools, s.tools
            pair.tools_reordered = bool(
                pt is not None and ct is not None and pt != ct and sorted(pt) == sorted(ct)
            )
            min_run = max(s.block_size, ANCHOR_TOKENS)
            if not pair.extends and not pair.tools_reordered and shorter - d >= min_run:
                found = find_resync(prev, ids, d, min_run=min_run)
                if found is not None:
                    pair.resync = found
                    _, jc, run = found
                    end = jc + run
                    pair.resume_tail = pack_slice(ids, max(jc, end - 12), end)
            group.pairs.append(pair)
            self._held -= len(prev)
        group.last_ids, group.last_hashes = ids, hashes
        group.last_key, group.last_tools = (s.cache_salt, s.lora), s.tools
        self._held += n
        if self._held > self.max_held_tokens:  # forget the least recent groups' prompts
            for g in self.groups.values():
                if self._held <= self.max_held_tokens or g is group:
                    break
                if g.last_ids is not None:
                    self._held -= len(g.last_ids)
                    g.last_ids = g.last_hashes = None

    # -- report -----------------------------------------------------------------------------
    def selection(
        self, model: str | None = None, tenant: str | None = None, app: str | None = None
    ) -> tuple[list[Record], list[Pair], list[tuple[GroupKey, int]]]:
        def ok(k: GroupKey) -> bool:
            return (
                (model is None or k[0] == model)
                and (tenant is None or k[1] == tenant)
                and (app is None or k[2] == app or (app in ("", "-", "none") and k[2] is None))
            )

        recs = [r for r in self.records if ok(r.key)]
        horizon = (recs[0].t if recs else math.inf) - 1e-9
        pairs = [p for k, g in self.groups.items() if ok(k) for p in g.pairs if p.t >= horizon]
        pairs.sort(key=lambda p: p.t)
        counts = Counter(r.key for r in recs)
        return recs, pairs, counts.most_common()

    def report(
        self,
        model: str | None = None,
        tenant: str | None = None,
        app: str | None = None,
        *,
        redact: bool = False,
        decode: DecodeFor | None = None,
        counters: Mapping[str, tuple[float, float]] | None = None,
        now: float | None = None,
    ) -> dict[str, Any]:
        now = self.clock() if now is None else now
        self._expire(now)
        recs, pairs, groups = self.selection(model, tenant, app)
        bs = self.block_size or 16
        text = None if redact else decode
        return build_report(
            recs,
            pairs,
            groups,
            block_size=bs,
            scope={"model": model, "tenant": tenant, "app": app},
            decode=text,
            redact=redact,
            counters=counters,
        )


def analyze(
    samples: Iterable[Sample],
    *,
    decode: DecodeFor | None = None,
    redact: bool = False,
    model: str | None = None,
    tenant: str | None = None,
    app: str | None = None,
) -> dict[str, Any]:
    """The report for a sequence of requests in arrival order (no window bounds)."""
    w = Window(
        max_requests=sys.maxsize,
        max_age_s=math.inf,
        max_blocks=sys.maxsize,
        pairs_per_group=1 << 30,
        max_groups=1 << 30,
        clock=lambda: 0.0,
    )
    timed = False
    for i, s in enumerate(samples):
        timed = timed or s.t is not None
        w.add(s, now=float(i) if s.t is None else s.t)
    rep = w.report(model, tenant, app, redact=redact, decode=decode, now=0.0)
    if not timed:
        rep["scope"]["window_s"] = None  # arrival order only
    return rep
