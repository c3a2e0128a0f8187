"""The pure analysis of requests: the sample the analysis sees, token and block-hash
comparisons (first divergence, resynchronisation), the attribution rule, and the records the
window keeps. Definitions: see the package docstring (router/ops/diagnose/__init__.py)."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

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
# A model's decoder: its own tokenizer's (None: no tokenizer, or text not shown). Token ids of
# one model mean nothing in another's vocabulary.
DecodeFor = Callable[[str], "Decode | None"]
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
    # The three reuse numbers (docs/diagnostics.md): what the chosen replica held (the
    # decision's matched blocks x block size), the most any candidate held, and what the
    # replica reported (usage's cached_tokens; None: not reported).
    captured_tokens: int | None = None
    available_tokens: int | None = None
    cached_tokens: int | None = None
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
    window = pack_slice(prev, d, d + max_span + anchor)
    stride = max(1, min_run - anchor + 1)
    for jc in range(d, min(len(cur) - anchor, d + max_span) + 1, stride):
        gram = pack_slice(cur, jc, jc + anchor)
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


def pack_slice(ids: Sequence[int], start: int, end: int) -> bytes:
    return array("I", ids[max(0, start) : max(0, end)]).tobytes()


def bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def bucket_of(index: int) -> int:
    for i, (lo, hi) in enumerate(BUCKETS):
        if index >= lo and (hi is None or index <= hi):
            return i
    return len(BUCKETS) - 1


def attribute(
    n: int, ideal: int, reusable: int | None, delivered: int | None
) -> dict[str, int | None]:
    """Split one request's ``n`` prompt tokens by the module's attribution rule. ``reusable``
    is ``C`` (None: no placement info, then ``C = ideal``); ``delivered`` is ``D`` or None."""
    ideal = max(0, min(ideal, n))
    c = ideal if reusable is None else max(0, min(reusable, ideal))
    if delivered is None:
        return {
            "delivered": None,
            "layout": n - ideal,
            "placement": ideal - c,
            "capacity": None,
            "unreported": c,
            "beyond_ideal": 0,
        }
    d = max(0, min(delivered, n))
    return {
        "delivered": d,
        "layout": n - max(ideal, d),
        "placement": max(0, ideal - max(c, d)),
        "capacity": max(0, c - d),
        "unreported": 0,
        "beyond_ideal": max(0, d - ideal),
    }


class Seen:
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


def held_blocks(hashes: Sequence[int], limit: int, seen: Seen, oldest: int) -> int:
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


# -- the window's records ---------------------------------------------------------------------
@dataclass(slots=True)
class Record:
    seq: int
    t: float
    key: GroupKey
    n: int
    blocks: int  # full prompt blocks (hashed) inserted into the ideal cache
    ideal: int
    replica: str | None
    replayed: int | None
    captured: int | None
    available: int | None
    delivered: int | None
    completion: int | None
    max_tokens: int | None


@dataclass(slots=True)
class Pair:
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
    model: str = ""  # the group's model: whose tokenizer decodes the ids

    @property
    def early(self) -> bool:
        return not self.extends and self.index < EARLY_FRACTION * min(self.prev_len, self.cur_len)

    def breaks(self, block_size: int) -> bool:
        """It leaves at least one full block of the shorter prompt behind the divergence."""
        return not self.extends and min(self.prev_len, self.cur_len) - self.index >= block_size


@dataclass(slots=True)
class Group:
    pairs: deque[Pair]
    last_ids: Sequence[int] | None = None  # the previous request's token ids (a reference)
    last_hashes: Sequence[int] | None = None
    last_key: tuple[str | None, str | None] = (None, None)  # (cache_salt, lora)
    last_tools: tuple[str, ...] | None = None


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
