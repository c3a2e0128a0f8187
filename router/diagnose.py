"""Why the prefix-cache hit rate is low, and where.

The seeds' procedure, automated: replay the window's prompts through one unlimited cache for
the **ideal** hit rate, compare it with the rate the gateway **predicted** for its placements
and the rate the replicas **measured**, split the gap into causes, and find the line of the
prompt that breaks the prefix with a **first-divergence histogram**.

Three ways in: ``GET /admin/diagnostics`` (live, ``LiveDiagnostics`` watches every finished
request), ``prefix-router diagnose FILE`` (offline, on captured request bodies, tokenized by the
gateway's own ``Gateway.prepare``), and :func:`analyze` (a pure function over a sequence of
:class:`Sample`).

Quantities (all in prompt tokens, per request; rates are sums over the window / prompt tokens)
-------------------------------------------------------------------------------------------
``n``  prompt tokens.
``I``  ideal: what one unlimited cache holding every earlier request of the window (same model;
       salt and LoRA separate, as in vLLM) would serve. vLLM's rules: full blocks only, the
       longest run from block 0, capped at ``n - 1`` tokens. Prompt blocks only: the generated
       tokens' ids are not known to the gateway (vLLM caches them too, see ``beyond ideal``).
``P``  predicted: the chosen replica's matched blocks in the decision (the index's belief).
``R``  replayed placement: what the chosen replica would hold with unlimited memory, given where
       this gateway actually sent the window's earlier requests.
``C``  placed-reusable = ``min(I, max(R, P))``: the part of the ideal the chosen replica should
       have held. Offline (no placement) ``C = I``.
``M``  measured: ``usage.prompt_tokens_details.cached_tokens``. vLLM omits the field on a miss,
       so once a replica has reported it at least once a missing value counts as 0; before
       that, ``M`` is unknown.

Attribution rule (a waterfall; the four parts add up to ``n``)
--------------------------------------------------------------
* ``hit       = M``
* ``capacity  = max(0, C - M)``            reusable, placed where it was, yet not served: the
  replica evicted it before the reuse (or lost it: restart, reset).
* ``placement = max(0, I - max(C, M))``     an unlimited cache had it, but the chosen replica
  did not: another replica held more (from the replay, and the decision's scores).
* ``layout    = n - max(I, M)``             not reusable even by one unlimited cache: the prompt
  diverges from every earlier prompt there (a volatile line, reordered tools, new content).

When ``M`` is unknown, ``capacity`` cannot be seen: ``layout`` and ``placement`` are as above
and ``C`` is reported as *unmeasured*. ``M > I`` (blocks cached before the window began,
generated tokens, another gateway's traffic) is counted as a hit and reported as
*beyond ideal*. The order is deliberate: a token is blamed on the cheapest explanation that
covers it (the prompt first, then routing, then memory), so eviction is only claimed for tokens
that were reusable *and* correctly placed. Separately, ``index_spills`` counts decisions whose
scores show a replica believed to hold more than the chosen one (a load spill).

Divergence
----------
For consecutive requests of the same (model, tenant, app) group the first differing token index
is bucketed (0-15, 16-63, 64-255, 256-1023, 1024-4095, 4096+). A divergence is *early* when it
leaves more than half of the shorter prompt behind it, and *breaking* when it leaves at least a
full block; a pair where one prompt continues the other (a conversation's next turn) is
*extending*. Culprits come from the tallest buckets (early pairs first, then breaking ones),
each at its most common index, with the decoded text just before and after the point and the
line around it. A breaking pair whose prompts agree again within ``MAX_SPAN`` tokens for at
least a block gives a *reordering* suggestion: the volatile span, the line holding it, where
the shared text after it ends, and the block-aligned tokens that moving the span behind that
text would make reusable. Two cheap checks on the bodies add hints: the same tools in another
order, and another ``cache_salt`` / adapter (which shares nothing by design). Redaction drops
every text field; positions, counts and the heuristic kind labels stay.

Verdict
-------
The largest of layout / placement / capacity, except that layout is only named the cause when
it is fixable (early divergences in >= 25% of pairs, reordered tools in >= 25%, or reordering
suggestions unlocking >= 10% of prompt tokens); otherwise the unreusable tokens are new content,
and the larger of placement / capacity is the cause if it costs >= 5% of prompt tokens, else
the traffic is *healthy*.

Decode-bound: when completion tokens are at least ``DECODE_BOUND_RATIO`` x prompt tokens, the
time goes into sequential decode steps, which the prefix cache does not shorten.

Bounds (live): at most ``max_requests`` records, ``max_age_s`` seconds and ``max_blocks``
prompt blocks in the window (the two generations of block-hash maps hold at most twice that),
``pairs_per_group`` divergence records per group (~100 packed context token ids each),
``max_groups`` groups, and ``max_held_tokens`` token ids in total held as the groups' previous
requests (a reference to the gateway's own list, not a copy). ``observe`` costs O(log n) hash
lookups, one C-level dict update per block for the ideal and one for the replay, an O(log n)
hash comparison with the group's previous request, a few small slices and, when a volatile
span is found, one C-level comparison of the run after it: no per-token Python loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import sys
import time
import uuid
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

from router.blocks import block_hashes as chain_hashes
from router.blocks import cacheable_blocks

if TYPE_CHECKING:
    from aiohttp import web

    from router.app import Gateway
    from router.forward import Outcome
    from router.request import RoutedRequest
    from router.schedule import Decision

log = logging.getLogger("prefix_router.diagnose")

BUCKETS: tuple[tuple[int, int | None], ...] = (
    (0, 15),
    (16, 63),
    (64, 255),
    (256, 1023),
    (1024, 4095),
    (4096, None),
)
CONTEXT_TOKENS = 32  # kept before / after each divergence point
MAX_SPAN = 128  # the longest volatile span a reordering suggestion looks across
ANCHOR_TOKENS = 8  # tokens that must agree to call it a resynchronisation
EARLY_FRACTION = 0.5  # a divergence is early when it is before this fraction of the prompt
DECODE_BOUND_RATIO = 1.0  # completion / prompt tokens at which latency is decode-bound
SHOWN_CULPRITS = 3
SHOWN_SUGGESTIONS = 3
Decode = Callable[[Sequence[int]], str]
GroupKey = tuple[str, str, "str | None"]


# -- the request as the analysis sees it ------------------------------------------------------
@dataclass(slots=True)
class Sample:
    """One finished (or, offline, captured) request. Only ``token_ids`` and ``block_size`` are
    required; placement and outcome fields are None when unknown."""

    token_ids: Sequence[int]
    block_size: int
    model: str = ""
    tenant: str = "all"
    app: str | None = None
    block_hashes: Sequence[int] | None = None  # chained, salt/LoRA-keyed; computed when None
    cache_salt: str | None = None
    lora: str | None = None
    t: float | None = None
    replica: str | None = None  # chosen replica
    predicted_tokens: int | None = None  # the decision's matched blocks x block size
    best_predicted_tokens: int | None = None  # the most any candidate was believed to hold
    cached_tokens: int | None = None  # reported by the replica (None: not reported)
    completion_tokens: int | None = None
    max_tokens: int | None = None
    tools: tuple[str, ...] | None = None  # tool names in request order


# -- pure helpers -----------------------------------------------------------------------------
def unpack(data: bytes) -> list[int]:
    out = array("I")
    out.frombytes(data)
    return out.tolist()


def common_prefix(
    a: Sequence[int],
    b: Sequence[int],
    a_start: int = 0,
    b_start: int = 0,
    limit: int | None = None,
) -> int:
    """How many tokens ``a[a_start:]`` and ``b[b_start:]`` share from their start (at most
    ``limit``): slice comparisons in growing chunks (C speed), then a binary search inside the
    first chunk that differs."""
    n = min(len(a) - a_start, len(b) - b_start)
    if limit is not None:
        n = min(n, limit)
    if n <= 0:
        return 0
    i, step = 0, 64
    while i < n:
        j = min(n, i + step)
        if a[a_start + i : a_start + j] != b[b_start + i : b_start + j]:
            lo, hi = i, j  # equal up to lo; a difference in [lo, hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[a_start + lo : a_start + mid] == b[b_start + lo : b_start + mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        i, step = j, step * 2
    return n


def _equal_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading equal entries of two chained hash lists (equality is monotone along a chain)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    lo, hi = 1, n  # a[lo - 1] == b[lo - 1]; a[hi - 1] != b[hi - 1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def first_divergence(
    a: Sequence[int],
    b: Sequence[int],
    *,
    a_hashes: Sequence[int] | None = None,
    b_hashes: Sequence[int] | None = None,
    block_size: int = 16,
) -> int:
    """The first token index where ``a`` and ``b`` differ (``min(len)`` if one is a prefix of
    the other). With both prompts' chained block hashes (same salt and adapter), the differing
    block is found in O(log n) and only its tokens are compared."""
    if not isinstance(a, list) or not isinstance(b, list):
        a, b = list(a), list(b)
    if a_hashes is not None and b_hashes is not None:
        k = _equal_blocks(a_hashes, b_hashes)
        start = k * block_size
        within = block_size if k < min(len(a_hashes), len(b_hashes)) else None
        return start + common_prefix(a, b, start, start, within)
    return common_prefix(a, b)


def find_resync(
    prev: Sequence[int],
    cur: Sequence[int],
    d: int,
    *,
    max_span: int = MAX_SPAN,
    anchor: int = ANCHOR_TOKENS,
    min_run: int = 16,
) -> tuple[int, int, int] | None:
    """After a divergence at ``d``, where do two prompts agree again? Returns ``(prev_end,
    cur_end, run)``: ``prev[prev_end:]`` and ``cur[cur_end:]`` share ``run >= min_run`` tokens,
    ``cur_end`` within ``max_span`` of ``d``; None when there is no such point.

    Probes ``cur`` every ``min_run - anchor + 1`` tokens (any run of ``min_run`` contains a
    probe with a whole anchor inside it), looks each anchor up in ``prev``'s window with
    ``bytes.find``, then walks back to the run's first token."""
    window = _pack_slice(prev, d, d + max_span + anchor)
    stride = max(1, min_run - anchor + 1)
    for jc in range(d, min(len(cur) - anchor, d + max_span) + 1, stride):
        gram = _pack_slice(cur, jc, jc + anchor)
        pos = window.find(gram)
        while pos >= 0:
            if pos % 4 == 0:
                bp, bc = d + pos // 4, jc
                while bp > d and bc > d and prev[bp - 1] == cur[bc - 1]:
                    bp, bc = bp - 1, bc - 1
                run = common_prefix(prev, cur, bp, bc)
                if run >= min_run:
                    return bp, bc, run
            pos = window.find(gram, pos + 1)
    return None


def _pack_slice(ids: Sequence[int], start: int, end: int) -> bytes:
    return array("I", ids[max(0, start) : max(0, end)]).tobytes()


def bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def bucket_of(index: int) -> int:
    for i, (lo, hi) in enumerate(BUCKETS):
        if index >= lo and (hi is None or index <= hi):
            return i
    return len(BUCKETS) - 1


def attribute(
    n: int, ideal: int, placed: int | None, measured: int | None
) -> dict[str, int | None]:
    """Split one request's ``n`` prompt tokens by the module's attribution rule. ``placed`` is
    ``C`` (None: no placement info, then ``C = ideal``); ``measured`` is ``M`` or None."""
    ideal = max(0, min(ideal, n))
    c = ideal if placed is None else max(0, min(placed, ideal))
    if measured is None:
        return {
            "hit": None,
            "layout": n - ideal,
            "placement": ideal - c,
            "capacity": None,
            "unmeasured": c,
            "beyond_ideal": 0,
        }
    m = max(0, min(measured, n))
    return {
        "hit": m,
        "layout": n - max(ideal, m),
        "placement": max(0, ideal - max(c, m)),
        "capacity": max(0, c - m),
        "unmeasured": 0,
        "beyond_ideal": max(0, m - ideal),
    }


class _Seen:
    """Block hash -> sequence number of the newest record holding it, in two generations: the
    window rotates them every ``max_blocks`` inserted blocks, so entries older than the window
    are dropped wholesale, with no scan (every live record's blocks are in one of the two)."""

    __slots__ = ("cur", "prev")

    def __init__(self) -> None:
        self.cur: dict[int, int] = {}
        self.prev: dict[int, int] = {}

    def add(self, hashes: Sequence[int], seq: int) -> None:
        self.cur.update(zip(hashes, repeat(seq)))

    def get(self, h: int) -> int:
        v = self.cur.get(h)
        return self.prev.get(h, -1) if v is None else v

    def rotate(self) -> bool:
        """Start a new generation; False when nothing is left."""
        self.prev, self.cur = self.cur, {}
        return bool(self.prev)

    def __len__(self) -> int:
        return len(self.cur) + len(self.prev)


def _held_blocks(hashes: Sequence[int], limit: int, seen: _Seen, oldest: int) -> int:
    """Leading blocks of ``hashes`` (at most ``limit``) that a live record holds (its sequence
    number is not older than ``oldest``). Presence is monotone along a chain (a record holding
    block k holds blocks 0..k), so a binary search: O(log n) lookups."""
    if limit <= 0:
        return 0
    get = seen.get
    if get(hashes[0]) < oldest:
        return 0
    if get(hashes[limit - 1]) >= oldest:
        return limit
    lo, hi = 1, limit  # block lo-1 present, block hi-1 absent
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if get(hashes[mid - 1]) >= oldest:
            lo = mid
        else:
            hi = mid
    return lo


_TIMESTAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}|\b\d{1,2}:\d{2}(:\d{2})?\b|\b(19|20)\d{2}\b.*\b\d{1,2}\b|"
    r"\b(mon|tue|wed|thu|fri|sat|sun)[a-z]*\b|\b(today|date|time)\b",
    re.IGNORECASE,
)
_IDENT = re.compile(
    r"\b(req(uest)?|trace|session|correlation)[ _-]?(id)?\b|\b[0-9a-f]{8,}\b|\buuid\b",
    re.IGNORECASE,
)
_TOOL = re.compile(r'"name"\s*:\s*"|"function"\s*:|<tools>', re.IGNORECASE)


def classify(text: str) -> list[str]:
    """What kind of volatile content a culprit line looks like (heuristic labels)."""
    kinds = []
    if _TOOL.search(text):
        kinds.append("tools")
    if _TIMESTAMP.search(text):
        kinds.append("timestamp")
    if _IDENT.search(text):
        kinds.append("request_id")
    return kinds or ["text"]


def _line_around(before: str, after: str, limit: int = 240) -> str:
    head = before.rsplit("\n", 1)
    tail = after.split("\n", 1)
    line = ("" if len(head) > 1 else "…") + head[-1] + tail[0] + ("" if len(tail) > 1 else "…")
    return line if len(line) <= limit else line[: limit - 1] + "…"


# -- the window -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Record:
    seq: int
    t: float
    key: GroupKey
    n: int
    blocks: int  # full prompt blocks (hashed) inserted into the ideal cache
    ideal: int
    replica: str | None
    replayed: int | None
    predicted: int | None
    best: int | None
    measured: int | None
    completion: int | None
    max_tokens: int | None


@dataclass(slots=True)
class _Pair:
    """Two consecutive requests of one group: where they diverge, and the context."""

    t: float
    index: int
    prev_len: int
    cur_len: int
    extends: bool
    before: bytes  # packed token ids of the current request just before the divergence
    after_prev: bytes
    after_cur: bytes
    tools_reordered: bool = False
    key_differs: bool = False  # another cache_salt or adapter: no sharing from block 0
    resync: tuple[int, int, int] | None = None  # (prev_end, cur_end, run)
    resume_tail: bytes = b""  # the last tokens of the shared text after the span

    @property
    def early(self) -> bool:
        return not self.extends and self.index < EARLY_FRACTION * min(self.prev_len, self.cur_len)

    def breaks(self, block_size: int) -> bool:
        """It leaves at least one full block of the shorter prompt behind the divergence."""
        return not self.extends and min(self.prev_len, self.cur_len) - self.index >= block_size


@dataclass(slots=True)
class _Group:
    pairs: deque[_Pair]
    last_ids: Sequence[int] | None = None  # the previous request's token ids (a reference)
    last_hashes: Sequence[int] | None = None
    last_key: tuple[str | None, str | None] = (None, None)  # (cache_salt, lora)
    last_tools: tuple[str, ...] | None = None


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
        self.records: deque[_Record] = deque()
        self.groups: OrderedDict[GroupKey, _Group] = OrderedDict()
        self._seq = 0
        self._oldest = 0  # sequence number of the oldest live record
        self._blocks = 0  # prompt blocks of the live records
        self._generation = 0  # blocks inserted since the last rotation
        self._held = 0  # token ids held as the groups' previous requests
        self._ideal: dict[str, _Seen] = {}  # per model: one unlimited cache
        self._placed: dict[tuple[str, str], _Seen] = {}  # per (model, replica): the replay
        self.block_size: int | None = None
        self.reporting_replicas: set[str] = set()  # replicas seen reporting cached_tokens
        # model -> [n, ideal, predicted_n, predicted, measured_n, measured]
        self.sums: dict[str, list[int]] = {}

    # -- ingest -----------------------------------------------------------------------------
    def add(self, s: Sample, now: float | None = None) -> _Record:
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
            ideal_seen = self._ideal[s.model] = _Seen()
        ideal = _held_blocks(hashes, limit, ideal_seen, oldest) * bs
        ideal_seen.add(hashes, seq)
        replayed = None
        if s.replica is not None:
            placed = self._placed.get((s.model, s.replica))
            if placed is None:
                placed = self._placed[(s.model, s.replica)] = _Seen()
            replayed = _held_blocks(hashes, limit, placed, oldest) * bs
            placed.add(hashes, seq)
        self._blocks += nb

        measured = s.cached_tokens
        if s.replica is not None:
            if measured is not None:
                self.reporting_replicas.add(s.replica)
            elif s.replica in self.reporting_replicas:
                measured = 0  # vLLM omits prompt_tokens_details on a miss
        key: GroupKey = (s.model, s.tenant, s.app)
        rec = _Record(
            seq,
            t,
            key,
            n,
            nb,
            ideal,
            s.replica,
            replayed,
            s.predicted_tokens,
            s.best_predicted_tokens,
            measured,
            s.completion_tokens,
            s.max_tokens,
        )
        self.records.append(rec)
        self._sum(rec, +1)
        self._diverge(key, s, ids, hashes, t)
        return rec

    def _sum(self, r: _Record, sign: int) -> None:
        acc = self.sums.setdefault(r.key[0], [0, 0, 0, 0, 0, 0])
        acc[0] += sign * r.n
        acc[1] += sign * r.ideal
        if r.predicted is not None:
            acc[2] += sign * r.n
            acc[3] += sign * r.predicted
        if r.measured is not None:
            acc[4] += sign * r.n
            acc[5] += sign * min(r.measured, r.n)

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
            group = self.groups[key] = _Group(deque(maxlen=self.pairs_per_group))
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
            pair = _Pair(
                t=t,
                index=d,
                prev_len=len(prev),
                cur_len=n,
                extends=d >= shorter,
                before=_pack_slice(ids, d - c, d),
                after_prev=_pack_slice(prev, d, d + c),
                after_cur=_pack_slice(ids, d, d + c),
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
                    pair.resume_tail = _pack_slice(ids, max(jc, end - 12), end)
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
    ) -> tuple[list[_Record], list[_Pair], list[tuple[GroupKey, int]]]:
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
        decode: Decode | None = None,
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


# -- report building --------------------------------------------------------------------------
def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def build_report(
    recs: Sequence[_Record],
    pairs: Sequence[_Pair],
    groups: Sequence[tuple[GroupKey, int]],
    *,
    block_size: int,
    scope: dict[str, Any],
    decode: Decode | None,
    redact: bool,
    counters: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    n_total = sum(r.n for r in recs)
    ideal_total = sum(r.ideal for r in recs)
    with_pred = [r for r in recs if r.predicted is not None]
    with_meas = [r for r in recs if r.measured is not None]
    parts = {"hit": 0, "layout": 0, "placement": 0, "capacity": 0, "unmeasured": 0}
    beyond = 0
    for r in recs:
        placed = None
        if r.replica is not None:
            placed = max(r.replayed or 0, r.predicted or 0)
        a = attribute(r.n, r.ideal, placed, r.measured)
        for k in parts:
            parts[k] += a[k] or 0
        beyond += a["beyond_ideal"] or 0
    spills = [r for r in with_pred if (r.best or 0) > (r.predicted or 0)]

    rates: dict[str, Any] = {
        "ideal": _rate(ideal_total, n_total),
        "predicted": _rate(sum(r.predicted or 0 for r in with_pred), sum(r.n for r in with_pred)),
        "measured": _rate(
            sum(min(r.measured or 0, r.n) for r in with_meas), sum(r.n for r in with_meas)
        ),
        "measured_requests": len(with_meas),
    }
    if counters:
        hits = sum(h for h, _ in counters.values())
        queries = sum(q for _, q in counters.values())
        rates["replica_counters"] = {
            "hit_rate": _rate(hits, queries),
            "hits": int(hits),
            "queries": int(queries),
            "replicas": {
                u: {"hits": int(h), "queries": int(q), "hit_rate": _rate(h, q)}
                for u, (h, q) in sorted(counters.items())
            },
        }

    lost = {
        k: {"tokens": parts[k], "share": _rate(parts[k], n_total)}
        for k in ("layout", "placement", "capacity")
    }
    completion = sum(r.completion or 0 for r in recs)
    known_completion = any(r.completion is not None for r in recs)
    max_tok = sum(r.max_tokens or 0 for r in recs)
    if known_completion:
        ratio = completion / n_total if n_total else 0.0
        decode_bound: dict[str, Any] = {
            "flag": ratio >= DECODE_BOUND_RATIO,
            "basis": "completion_tokens",
            "completion_tokens": completion,
        }
    else:
        ratio = max_tok / n_total if n_total else 0.0
        decode_bound = {
            "flag": ratio >= DECODE_BOUND_RATIO,
            "basis": "max_tokens (an upper bound; completions unknown)",
            "max_tokens": max_tok,
        }
    decode_bound.update(prompt_tokens=n_total, ratio=round(ratio, 3), threshold=DECODE_BOUND_RATIO)

    divergence = _divergence_section(pairs, block_size, decode)
    suggestions = _suggestions(pairs, block_size, decode)
    span_s = (recs[-1].t - recs[0].t) if len(recs) > 1 else 0.0
    report: dict[str, Any] = {
        "scope": {
            **scope,
            "requests": len(recs),
            "prompt_tokens": n_total,
            "block_size": block_size,
            "window_s": round(span_s, 3),
            "redacted": redact,
        },
        "hit_rates": rates,
        "tokens": {
            "prompt": n_total,
            "ideal": ideal_total,
            "hit": parts["hit"],
            "beyond_ideal": beyond,
            "unmeasured": {
                "tokens": parts["unmeasured"],
                "share": _rate(parts["unmeasured"], n_total),
            },
            "lost": lost,
        },
        "index_spills": {
            "requests": len(spills),
            "tokens": sum((r.best or 0) - (r.predicted or 0) for r in spills),
        },
        "decode_bound": decode_bound,
        "divergence": divergence,
        "suggestions": suggestions,
        "groups": [
            {"model": k[0], "tenant": k[1], "app": k[2], "requests": c} for k, c in groups[:20]
        ],
    }
    report["verdict"] = _verdict(report)
    return report


def _divergence_section(pairs: Sequence[_Pair], bs: int, decode: Decode | None) -> dict[str, Any]:
    counts = [0] * len(BUCKETS)
    early = [0] * len(BUCKETS)
    breaking = [0] * len(BUCKETS)
    by_bucket: dict[int, list[_Pair]] = {}
    for p in pairs:
        b = bucket_of(p.index)
        counts[b] += 1
        early[b] += p.early
        if p.breaks(bs):
            breaking[b] += 1
            by_bucket.setdefault(b, []).append(p)
    indexes = sorted(p.index for p in pairs)
    out: dict[str, Any] = {
        "pairs": len(pairs),
        "early_pairs": sum(early),
        "breaking_pairs": sum(breaking),
        "extending_pairs": sum(1 for p in pairs if p.extends),
        "tools_reordered_pairs": sum(1 for p in pairs if p.tools_reordered),
        "cache_key_differs_pairs": sum(1 for p in pairs if p.key_differs),
        "median_index": indexes[len(indexes) // 2] if indexes else None,
        "buckets": [
            {
                "range": bucket_label(lo, hi),
                "lo": lo,
                "hi": hi,
                "count": counts[i],
                "early": early[i],
                "breaking": breaking[i],
            }
            for i, (lo, hi) in enumerate(BUCKETS)
        ],
    }
    culprits = []
    # The tallest buckets of early divergences first, then of any divergence that loses a block.
    for b in sorted(by_bucket, key=lambda i: (-early[i], -breaking[i], i))[:SHOWN_CULPRITS]:
        ps = by_bucket[b]
        at = Counter(p.index for p in ps)
        index, n_at = max(at.items(), key=lambda kv: (kv[1], -kv[0]))
        example = next(p for p in reversed(ps) if p.index == index)
        lost = sorted(min(p.prev_len, p.cur_len) - p.index for p in ps)
        reordered = sum(1 for p in ps if p.tools_reordered)
        c: dict[str, Any] = {
            "bucket": bucket_label(*BUCKETS[b]),
            "pairs": len(ps),
            "early_pairs": early[b],
            "index": index,
            "pairs_at_index": n_at,
            "block": index // bs,
            "offset_in_block": index % bs,
            "median_tokens_after": lost[len(lost) // 2],
            "tools_reordered_pairs": reordered,
        }
        if decode is not None:
            before = decode(unpack(example.before))
            after_cur = decode(unpack(example.after_cur))
            after_prev = decode(unpack(example.after_prev))
            c["line"] = _line_around(before, after_cur)
            c["previous_line"] = _line_around(before, after_prev)
            c["before"] = before
            c["after_previous"] = after_prev
            c["after_current"] = after_cur
            variants: list[str] = []
            for p in reversed(ps):
                if p.index == index:
                    v = _line_around(decode(unpack(p.before)), decode(unpack(p.after_cur)))
                    if v not in variants:
                        variants.append(v)
                    if len(variants) >= 3:
                        break
            c["variants"] = variants
            kinds = classify(c["line"] + "\n" + c["previous_line"])
        else:
            kinds = []
        if reordered * 2 >= len(ps):
            kinds = ["tool_order"] + [k for k in kinds if k not in ("tools", "text")]
        if kinds:
            c["kind"] = kinds
        culprits.append(c)
    out["culprits"] = culprits
    return out


def _context_slice(p: _Pair, start: int, end: int) -> list[int]:
    """The current request's tokens [start, end) as far as the pair's context holds them."""
    ids = unpack(p.before) + unpack(p.after_cur)
    origin = p.index - len(p.before) // 4
    return ids[max(0, start - origin) : max(0, end - origin)]


def _is_boundary(text: str) -> bool:
    return "\n" in text or (text.startswith("<|") and text.endswith("|>"))


def _line_bounds(p: _Pair, start: int, end: int, decode: Decode) -> tuple[int, int] | None:
    """Token bounds [a, b) of the line holding [start, end) in the current request, when the
    pair's context reaches both ends (a newline or a special token on each side)."""
    ids = unpack(p.before) + unpack(p.after_cur)
    origin = p.index - len(p.before) // 4
    lo, hi = start - origin, end - origin
    if lo < 0 or hi > len(ids) or lo >= hi:
        return None
    a = next((i + 1 for i in range(lo - 1, -1, -1) if _is_boundary(decode([ids[i]]))), None)
    b = None
    for i in range(max(lo, hi - 1), len(ids)):
        text = decode([ids[i]])
        if _is_boundary(text):
            b = i if text.startswith("<|") else i + 1  # a trailing newline belongs to the line
            break
    if a is None or b is None or b <= a:
        return None
    return a + origin, b + origin


def _suggestions(pairs: Sequence[_Pair], bs: int, decode: Decode | None) -> list[dict[str, Any]]:
    """Reordering: clusters of pairs whose prompts agree again after a short volatile span."""
    out: list[dict[str, Any]] = []
    spans = sorted((p for p in pairs if p.resync is not None), key=lambda p: p.index)
    clusters: list[list[_Pair]] = []
    cluster_end = -1
    for p in spans:
        assert p.resync is not None
        end = max(p.resync[1], p.index + 1)
        if clusters and p.index <= cluster_end + bs:
            clusters[-1].append(p)
            cluster_end = max(cluster_end, end)
        else:
            clusters.append([p])
            cluster_end = end
    scored = []
    for cl in clusters:
        gains, resumes = [], []
        end = 0
        for p in cl:
            assert p.resync is not None
            jp, jc, run = p.resync
            gains.append(((p.index + run) // bs - p.index // bs) * bs)
            resumes.append(jc + run)
            end = max(end, jc)  # the current request's coordinates
        if not any(gains):
            continue
        gains.sort()
        resumes.sort()
        start = min(p.index for p in cl)
        if end <= start:  # only the earlier requests carried extra tokens here
            end = max(max(p.resync[0], p.resync[1]) for p in cl if p.resync)
        scored.append((sum(gains), cl, start, end, resumes[len(resumes) // 2], gains))
    scored.sort(key=lambda x: -x[0])
    for total, cl, start, end, resume, gains in scored[:SHOWN_SUGGESTIONS]:
        median_gain = gains[len(gains) // 2]
        s: dict[str, Any] = {
            "kind": "move_volatile_span",
            "start": start,
            "end": end,
            "tokens": end - start,
            "resume_end": resume,
            "pairs": len(cl),
            "unlock_tokens_per_request": median_gain,
            "unlock_tokens_total": total,
        }
        what = f"the {end - start} tokens at {start}..{end}"
        where = f"later, behind the text the requests share after it (to about token {resume})"
        if decode is not None:
            latest = max(cl, key=lambda p: p.t)
            s["span_text"] = decode(_context_slice(latest, start, end))
            bounds = _line_bounds(latest, start, end, decode)
            if bounds is not None:
                s["line_start"], s["line_end"] = bounds
                s["line"] = decode(_context_slice(latest, *bounds)).rstrip("\n")
                what = (
                    f"the line {json.dumps(s['line'], ensure_ascii=False)} (tokens "
                    f"{bounds[0]}..{bounds[1]}; {end - start} of them vary, at {start}..{end})"
                )
            else:
                what += f" ({json.dumps(s['span_text'], ensure_ascii=False)})"
            s["resume_after_text"] = decode(unpack(latest.resume_tail))
            tail = json.dumps("…" + s["resume_after_text"], ensure_ascii=False)
            where += f", which ends {tail}"
        s["message"] = (
            f"move {what} {where}: about {median_gain:,} more reusable tokens per request "
            f"({len(cl)} of {len(pairs)} consecutive pairs agree again after the span)"
        )
        out.append(s)
    keyed = sum(1 for p in pairs if p.key_differs)
    if keyed:
        out.append(
            {
                "kind": "cache_key_differs",
                "pairs": keyed,
                "message": f"{keyed} of {len(pairs)} consecutive pairs carry a different "
                "cache_salt or LoRA adapter: by design they share no cached block, whatever "
                "their tokens (check the salt policy if these should share)",
            }
        )
    reordered = sum(1 for p in pairs if p.tools_reordered)
    if reordered:
        at = Counter(p.index for p in pairs if p.tools_reordered).most_common(1)[0][0]
        out.append(
            {
                "kind": "stable_tool_order",
                "pairs": reordered,
                "index": at,
                "message": f"{reordered} of {len(pairs)} consecutive pairs sent the same tools "
                f"in a different order (first at token {at}): serialize tools in a fixed "
                "order, e.g. sorted by name",
            }
        )
    return out


def _verdict(rep: dict[str, Any]) -> dict[str, Any]:
    """The main cause: the largest of layout / placement / capacity, except that layout only
    counts as the cause when it is fixable (early divergences are common, or a reordering
    would unlock >= 10% of prompt tokens); otherwise the unreusable tokens are new content and
    the larger of placement / capacity is the cause if it costs >= 5%, else it is healthy."""
    lost = rep["tokens"]["lost"]
    n = rep["tokens"]["prompt"]
    if not n:
        return {"cause": "no_data", "message": "no requests in the window"}
    causes = {k: lost[k]["tokens"] for k in ("layout", "placement", "capacity")}
    cause = max(causes, key=lambda k: (causes[k], k == "layout"))
    div = rep["divergence"]
    early_share = div["early_pairs"] / div["pairs"] if div["pairs"] else 0.0
    unlock = sum(s.get("unlock_tokens_total", 0) for s in rep["suggestions"])
    reordered = div["tools_reordered_pairs"] / div["pairs"] if div["pairs"] else 0.0
    fixable = early_share >= 0.25 or unlock >= 0.1 * n or reordered >= 0.25
    if cause == "layout" and not fixable:
        other = max(("placement", "capacity"), key=lambda k: causes[k])
        cause = other if causes[other] >= 0.05 * n else "healthy"
    msg = {
        "layout": f"the prompts break their own prefix: {lost['layout']['share']:.1%} of prompt "
        "tokens are not reusable even by one unlimited cache",
        "placement": f"requests land where their prefix is not: {lost['placement']['share']:.1%}"
        " of prompt tokens were held by another replica than the chosen one",
        "capacity": f"the cache is too small: {lost['capacity']['share']:.1%} of prompt tokens "
        "were reusable and correctly placed but evicted before reuse",
        "healthy": "the cache reuses what the prompts allow; the unreusable tokens are new "
        "content (late divergence), not a broken prefix",
    }[cause]
    if cause == "layout" and rep["suggestions"]:
        msg += f"; {rep['suggestions'][0]['message']}"
    elif cause == "layout" and div["culprits"]:
        c = div["culprits"][0]
        msg += f"; most consecutive requests first differ at token {c['index']}"
    if rep["decode_bound"]["flag"]:
        msg += (
            "; note: decode-bound (completion tokens dwarf prompt tokens), a higher hit rate "
            "will not move latency much"
        )
    return {"cause": cause, "message": msg, "early_divergence_share": round(early_share, 3)}


# -- text rendering ---------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.1%}"


def render_text(rep: dict[str, Any]) -> str:
    sc, hr, tk = rep["scope"], rep["hit_rates"], rep["tokens"]
    lines = []
    label = ", ".join(f"{k} {sc[k]}" for k in ("model", "tenant", "app") if sc.get(k))
    lines.append(
        f"prefix-cache diagnosis{' — ' + label if label else ''}: {sc['requests']} requests, "
        f"{sc['prompt_tokens']:,} prompt tokens"
        + (f" over {sc['window_s']:.1f} s" if sc.get("window_s") is not None else "")
        + f", block size "
        f"{sc['block_size']}{' (redacted)' if sc['redacted'] else ''}"
    )
    lines.append("")
    rc = hr.get("replica_counters")
    lines.append(
        f"hit rate   ideal {_pct(hr['ideal'])}   predicted {_pct(hr['predicted'])}   measured "
        f"{_pct(hr['measured'])} ({hr['measured_requests']} requests)"
        + (f"   replica counters {_pct(rc['hit_rate'])}" if rc else "")
    )
    lines.append("")
    lines.append("where the prompt tokens went")
    n = max(tk["prompt"], 1)
    rows = [("cached (measured)", tk["hit"], "")]
    rows += [
        ("lost to prompt layout", tk["lost"]["layout"]["tokens"], "not reusable by any cache"),
        ("lost to placement", tk["lost"]["placement"]["tokens"], "another replica held it"),
        ("lost to capacity", tk["lost"]["capacity"]["tokens"], "evicted before reuse"),
    ]
    if tk["unmeasured"]["tokens"]:
        rows.append(
            (
                "reusable, unmeasured",
                tk["unmeasured"]["tokens"],
                "no cached_tokens to compare (offline, or not reported)",
            )
        )
    for name, v, why in rows:
        lines.append(f"  {name:<22} {v:>10,} {v / n:6.1%}  {why}".rstrip())
    if tk["beyond_ideal"]:
        lines.append(f"  (of the cached, {tk['beyond_ideal']:,} beyond the window's ideal)")
    sp = rep["index_spills"]
    if sp["requests"]:
        lines.append(
            f"  index spills: {sp['requests']} requests went to a replica believed to hold "
            f"{sp['tokens']:,} tokens less than another (load)"
        )
    v = rep["verdict"]
    lines.append("")
    lines.append(f"verdict: {v['cause']} — {v['message']}")
    div = rep["divergence"]
    lines.append("")
    lines.append(
        f"first divergence between consecutive requests of a group ({div['pairs']} pairs, "
        f"{div['early_pairs']} early, median token {div['median_index']})"
    )
    top = max((b["count"] for b in div["buckets"]), default=0) or 1
    for b in div["buckets"]:
        bar = "#" * round(40 * b["count"] / top)
        lines.append(f"  tokens {b['range']:<10} {b['count']:>5}  {bar}".rstrip())
    for i, c in enumerate(div["culprits"], 1):
        lines.append("")
        lines.append(
            f"culprit {i}: {c['pairs']} pairs ({c['early_pairs']} early) in tokens {c['bucket']}, "
            f"{c['pairs_at_index']} at token {c['index']} (block {c['block']} + "
            f"{c['offset_in_block']}), ~{c['median_tokens_after']:,} tokens lost behind it"
            + (f" [{', '.join(c['kind'])}]" if c.get("kind") else "")
        )
        if "line" in c:
            lines.append(f"  line      {json.dumps(c['line'], ensure_ascii=False)}")
            lines.append(f"  previous  {json.dumps(c['previous_line'], ensure_ascii=False)}")
            lines.append(f"  before    {json.dumps(c['before'][-80:], ensure_ascii=False)}")
            lines.append(f"  after     {json.dumps(c['after_current'][:80], ensure_ascii=False)}")
            lines.append(f"  vs        {json.dumps(c['after_previous'][:80], ensure_ascii=False)}")
    if rep["suggestions"]:
        lines.append("")
        lines.append("suggestions")
        for s in rep["suggestions"]:
            lines.append(f"  - {s['message']}")
    db = rep["decode_bound"]
    lines.append("")
    lines.append(
        f"decode-bound: {'YES' if db['flag'] else 'no'} ({db['basis']}: ratio {db['ratio']} "
        f"of prompt tokens, threshold {db['threshold']})"
    )
    if len(rep["groups"]) > 1:
        lines.append("")
        lines.append("groups (model / tenant / app: requests)")
        for g in rep["groups"]:
            lines.append(f"  {g['model']} / {g['tenant']} / {g['app'] or '-'}: {g['requests']}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


# -- pure entry point -------------------------------------------------------------------------
def analyze(
    samples: Iterable[Sample],
    *,
    decode: Decode | None = None,
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


def tool_names(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The tool names of a chat body, in request order (None: no tool list)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    names = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        names.append(str(f.get("name", "")) if isinstance(f, dict) else "")
    return tuple(names)


# -- live -------------------------------------------------------------------------------------
class LiveDiagnostics:
    """Watches every finished request (``observe``) and answers ``report`` on demand."""

    def __init__(
        self,
        gateway: Gateway,
        window: Window | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        gauge_interval_s: float = 1.0,
        counter_interval_s: float = 1.0,
    ) -> None:
        from prometheus_client import Gauge

        self.gateway = gateway
        self.clock = clock
        self.window = window or Window(clock=clock)
        self.gauge_interval_s = gauge_interval_s
        self.counter_interval_s = counter_interval_s
        reg = gateway.metrics.registry
        self.ideal_gauge = Gauge(
            "prefix_router_ideal_hit_rate",
            "Prefix-cache hit rate one unlimited cache would reach on the diagnostics window",
            ["model"],
            registry=reg,
        )
        self.predicted_gauge = Gauge(
            "prefix_router_predicted_hit_rate",
            "Prefix-cache hit rate the gateway predicted for its placements (window)",
            ["model"],
            registry=reg,
        )
        self.measured_gauge = Gauge(
            "prefix_router_measured_hit_rate",
            "Prefix-cache hit rate the replicas reported in usage (window)",
            ["model"],
            registry=reg,
        )
        self._gauges_at: dict[str, float] = {}
        self._snaps: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()
        self.errors = 0

    def observe(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        try:
            if outcome.status >= 400:
                return
            now = self.clock()
            tools = tool_names(rr.body) if rr.endpoint == "chat" else None
            bs = rr.block_size
            best = max((s.matched_blocks for s in decision.scores), default=None)
            self.window.add(
                Sample(
                    token_ids=rr.token_ids,
                    block_size=bs,
                    model=rr.model,
                    tenant=rr.tenant,
                    app=rr.app_label,
                    block_hashes=rr.block_hashes,
                    cache_salt=rr.cache_salt,
                    lora=rr.lora,
                    replica=decision.replica,
                    predicted_tokens=decision.matched_blocks * bs,
                    best_predicted_tokens=None if best is None else best * bs,
                    cached_tokens=outcome.cached_tokens,
                    completion_tokens=outcome.completion_tokens,
                    max_tokens=rr.max_tokens,
                    tools=tools,
                ),
                now,
            )
            self._snapshot(now)
            if now - self._gauges_at.get(rr.model, -math.inf) >= self.gauge_interval_s:
                self._gauges_at[rr.model] = now
                self.update_gauges(rr.model)
        except Exception:  # never let diagnostics break the request path
            self.errors += 1
            log.debug("diagnostics observe failed", exc_info=True)

    def update_gauges(self, model: str | None = None) -> None:
        for m, acc in self.window.sums.items():
            if model is not None and m != model:
                continue
            n, ideal, pn, pred, mn, meas = acc
            if n:
                self.ideal_gauge.labels(m).set(ideal / n)
            if pn:
                self.predicted_gauge.labels(m).set(pred / pn)
            if mn:
                self.measured_gauge.labels(m).set(meas / mn)

    def _counters_now(self) -> dict[str, tuple[float, float]]:
        fleet = self.gateway.fleet
        if fleet is None:
            return {}
        return {u: (r.stats.prefix_hits, r.stats.prefix_queries) for u, r in fleet.replicas.items()}

    def _snapshot(self, now: float) -> None:
        snaps = self._snaps
        if snaps and now - snaps[-1][0] < self.counter_interval_s:
            return
        snaps.append((now, self._counters_now()))
        horizon = now - self.window.max_age_s
        while len(snaps) > 2 and snaps[1][0] <= horizon:
            snaps.popleft()

    def counter_deltas(self) -> dict[str, tuple[float, float]]:
        """The replicas' ``vllm:prefix_cache_hits/queries_total`` deltas over the window."""
        if not self._snaps:
            return {}
        base = self._snaps[0][1]
        out = {}
        for url, (h, q) in self._counters_now().items():
            h0, q0 = base.get(url, (0.0, 0.0))
            if h < h0 or q < q0:  # the replica restarted: its counters began again
                h0 = q0 = 0.0
            out[url] = (h - h0, q - q0)
        return {u: v for u, v in out.items() if v[1] > 0}

    def report(
        self,
        model: str | None = None,
        tenant: str | None = None,
        app: str | None = None,
        redact: bool = False,
    ) -> dict[str, Any]:
        renderer = self.gateway.renderer
        decode = renderer.decode if renderer is not None else None
        rep = self.window.report(
            model, tenant, app, redact=redact, decode=decode, counters=self.counter_deltas()
        )
        self.update_gauges()
        return rep

    def render(self, **kwargs: Any) -> str:
        return render_text(self.report(**kwargs))


async def handle(gateway: Gateway, request: web.Request) -> web.Response:
    """``GET /admin/diagnostics?model=&tenant=&app=&format=json|text&redact=1``."""
    from aiohttp import web

    from router.errors import bad_request
    from router.explain import check_admin

    check_admin(request, gateway.config.admin_key, required=True)
    diag: LiveDiagnostics | None = getattr(gateway, "diagnostics", None)
    if diag is None:
        diag = gateway.diagnostics = LiveDiagnostics(gateway)
        gateway.observers.append(diag)
    q = request.query
    fmt = q.get("format", "json").lower()
    if fmt not in ("json", "text"):
        raise bad_request("format must be json or text", "format")
    redact = q.get("redact", "").lower() in ("1", "true", "yes")
    rep = diag.report(
        model=q.get("model") or None,
        tenant=q.get("tenant") or None,
        app=q.get("app") or None,
        redact=redact,
    )
    if fmt == "text":
        return web.Response(text=render_text(rep), content_type="text/plain")
    return web.json_response(rep)


# -- offline ----------------------------------------------------------------------------------
def _field(body: Mapping[str, Any], path: str) -> str | None:
    cur: Any = body
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    if cur is None:
        return None
    return (cur if isinstance(cur, str) else json.dumps(cur, sort_keys=True))[:64]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="prefix-router diagnose",
        description="Explain a low prefix-cache hit rate from captured request bodies (JSON "
        "lines of OpenAI chat/completions bodies, in arrival order): the ideal hit rate, the "
        "first-divergence histogram with the culprit lines, and reordering suggestions. "
        "Tokenized exactly as the live gateway does (Gateway.prepare).",
    )
    p.add_argument("file", help="JSON-lines file of request bodies ('-': standard input)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or cached model id")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--group-by", help="body field to group by, e.g. user or metadata.app")
    p.add_argument("--config", help="gateway config file (salt policy, tenants)")
    p.add_argument("--redact", action="store_true", help="positions and counts only, no text")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)

    from router.app import offline_gateway
    from router.config import ConfigError
    from router.errors import APIError
    from router.explain import endpoint_of

    try:
        gateway = offline_gateway(a.tokenizer, a.block_size, a.config)
    except ConfigError as e:
        print(f"prefix-router diagnose: {e}", file=sys.stderr)
        return 2
    try:
        stream = sys.stdin if a.file == "-" else open(a.file, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        print(f"prefix-router diagnose: {e}", file=sys.stderr)
        return 2

    samples: list[Sample] = []
    skipped: list[str] = []

    async def run() -> None:
        with stream:
            for n, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    body = json.loads(line)
                    endpoint = endpoint_of(body)
                    rr = await gateway.prepare(
                        line.encode(), {}, endpoint, f"line-{n}-{uuid.uuid4().hex[:6]}"
                    )
                except ValueError as e:
                    skipped.append(f"line {n}: not JSON: {e}")
                    continue
                except APIError as e:
                    skipped.append(f"line {n}: {e.message}")
                    continue
                samples.append(
                    Sample(
                        token_ids=rr.token_ids,
                        block_size=rr.block_size,
                        model=rr.model,
                        tenant="all",
                        app=_field(body, a.group_by) if a.group_by else None,
                        block_hashes=rr.block_hashes,
                        cache_salt=rr.cache_salt,
                        lora=rr.lora,
                        max_tokens=rr.max_tokens,
                        tools=tool_names(body) if endpoint == "chat" else None,
                    )
                )

    asyncio.run(run())
    gateway.executor.shutdown(wait=False)
    renderer = gateway.renderer
    rep = analyze(
        samples,
        decode=None if a.redact or renderer is None else renderer.decode,
        redact=a.redact,
    )
    rep["scope"]["source"] = a.file
    rep["scope"]["group_by"] = a.group_by
    rep["scope"]["skipped_lines"] = len(skipped)
    for s in skipped[:5]:
        print(f"prefix-router diagnose: skipped {s}", file=sys.stderr)
    if a.json:
        print(json.dumps(rep, indent=2, ensure_ascii=False))
    else:
        print(render_text(rep), end="")
    return 0 if samples else 1


__all__ = [
    "BUCKETS",
    "LiveDiagnostics",
    "Sample",
    "Window",
    "analyze",
    "attribute",
    "bucket_of",
    "find_resync",
    "first_divergence",
    "handle",
    "main",
    "render_text",
]
