"""The segment-cache tokenizer: a prompt's ids as the concatenation of its segments' ids.

Hugging Face tokenizers cut the text at added tokens (``<|im_start|>``, ...) before
normalising and running BPE, so a rendered prompt's ids are the concatenation of each
segment's ids. The ids of each segment are kept in an LRU keyed by the XXH3-128 of its UTF-8
bytes, seeded by the request's cache-salt scope (``cache_scope``), and bounded by the number
of cached tokens, so a repeated 3,000-token system prompt costs a hash and a dict lookup. The
split is only used when it is provably equivalent for the tokenizer (see ``_split_safe``);
otherwise the whole text is encoded.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from router.errors import APIError
from router.prompt.fast_encode import FAST, FAST_MAX_CHARS, REFERENCE, PlainEncoder, plain_encoder
from router.prompt.fields import TokenIds, error

log = logging.getLogger(__name__)  # a child of "router.prompt", the logger it used to be

DEFAULT_SEGMENT_CACHE_TOKENS = 2_000_000
"""Token budget of the segment cache (ids are stored as 4-byte ints: ~8 MB plus per-entry
overhead)."""


class NeedsThread(Exception):
    """Raised inside ``Renderer.inline(...)`` when the prompt has more uncached text than the
    inline budget: the caller should tokenize it in a worker thread instead."""


# Per-thread (per-context) budget of uncached characters to BPE-encode inline; None = any.
_INLINE_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "prefix_router_inline_budget", default=None
)
# Seed of the segment-cache keys in this context: the request's cache-salt scope (0 = the
# unsalted scope). A hit is fast and a miss is slow, so a cache shared across scopes would
# let one tenant time whether another recently sent a text; keys seeded by the scope keep
# the scopes as far apart as the replicas' salted prefix caches are.
_CACHE_SCOPE: contextvars.ContextVar[int] = contextvars.ContextVar(
    "prefix_router_cache_scope", default=0
)


def current_scope() -> int:
    """The segment-cache seed of the scope in force (``cache_scope``)."""
    return _CACHE_SCOPE.get()


def cache_scope_seed(cache_salt: str | None) -> int:
    """The segment-cache seed of requests sent with ``cache_salt`` (0 when unsalted)."""
    if not cache_salt:
        return 0
    return xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass")) or 1


_SEARCH_WINDOW = 1 << 16


def _search_cut(text: str, pos: int) -> re.Match[str] | None:
    """``_SAFE_CUT.search(text, pos)``, a window of characters at a time: one regex call over
    megabytes with no cut (3.9M spaces) held the GIL for 70-150 ms, and the event loop with it;
    between windows it can change hands. A window reaches one character past its end, so the
    lookahead of a cut at its last position is seen."""
    n = len(text)
    while pos < n:
        m = _SAFE_CUT.search(text, pos, min(n, pos + _SEARCH_WINDOW + 1))
        if m is not None:
            return m
        pos += _SEARCH_WINDOW
    return None


def fast_pieces(text: str, limit: int = FAST_MAX_CHARS) -> list[str]:
    """``text`` cut at ``_SAFE_CUT`` (exact for a chunkable tokenizer) into pieces of at most
    ``limit`` characters where the last ``limit // 16`` characters before the limit hold a
    cut; a piece is longer only where they do not (up to the next cut, or the end)."""
    out: list[str] = []
    pos, n = 0, len(text)
    while n - pos > limit:
        m = _SAFE_CUT.search(text, pos + limit - limit // 16, pos + limit)
        if m is None:
            m = _search_cut(text, pos + limit)
            if m is None:
                break
        out.append(text[pos : m.end()])
        pos = m.end()
    out.append(text[pos:])
    return out


def _cut_long(encode: PlainEncoder) -> PlainEncoder:
    """``encode`` (fastokens) with segments over FAST_MAX_CHARS cut into pieces it encodes
    itself (``fast_pieces``), instead of whole by Hugging Face's BPE, ~50x slower. The GIL
    can change hands between pieces."""

    def encode_cut(segments: list[str]) -> list[Sequence[int]]:
        if all(len(s) <= FAST_MAX_CHARS for s in segments):
            return encode(segments)
        out: list[Sequence[int]] = []
        for s in segments:
            ids: list[int] = []
            for piece in fast_pieces(s):
                ids += encode([piece])[0]
            out.append(ids)
        return out

    return encode_cut


# -- the per-request tokenize budget ---------------------------------------------------------
# New text is BPE-encoded in pieces of about CHUNK_CHARS, the budget checked between them, so
# one request cannot hold a tokenizer thread for seconds. Pieces are cut where the whole-text
# tokenization provably has a token boundary too (``_SAFE_CUT``), so the ids are exact.
CHUNK_CHARS = 32_768
# Qwen2/Qwen3's pre-tokenizer (Split on this regex, Isolated; then ByteLevel without its own
# regex; NFC or no normalizer). For it, just before a space that follows a non-space
# character is always a pre-token boundary: no alternative of the regex runs from a
# non-space character into a following space (words are letters, numbers single
# characters, symbol runs stop at whitespace), the regex looks only ahead, and a space
# composes with nothing under NFC. Likewise before CJK punctuation after a CJK ideograph.
_CHUNKABLE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SAFE_CUT = re.compile(r"\S(?= )|[\u4e00-\u9fff](?=[\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f])")


def _whole_cost(rate: float, chars: int) -> float:
    """CPU seconds to BPE-encode ``chars`` characters with no cut whole, from ``rate`` (CPU
    per character encoding CHUNK_CHARS pieces of them). Whole is dearer per character the
    longer the run (BPE merges over one pre-token: measured with fastokens on runs of
    spaces, letters, newlines, symbols, digits and CJK, 2M characters cost 1.6-1.9x their
    32k pieces): this over-estimates that growth a little, so a run that is refused would
    not have fit, and one that is encoded fits."""
    return rate * chars * (1.0 + 0.15 * math.log2(max(1.0, chars / CHUNK_CHARS)))


@dataclass(slots=True)
class _Budget:
    cpu_s: float  # thread CPU seconds for new text, from the block's start
    deadline: float  # time.thread_time() at which it is spent
    max_tokens: int | None  # a prompt longer than this is refused (the model's context)
    tokens: int = 0  # prompt tokens found so far in this block


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "prefix_router_tokenize_budget", default=None
)


def over_budget(cpu_s: float, chars: int) -> APIError:
    return APIError(
        413,
        f"the prompt's new text ({chars} characters) would take more than {cpu_s:g} s of "
        "CPU to tokenize; send a shorter prompt (or, for the gateway's operator: raise "
        "max_tokenize_cpu_s)",
        param="messages",
        code="prompt_too_expensive",
    )


def over_context(max_tokens: int, at_least: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_tokens} tokens for the prompt. However, "
        f"your prompt has more than {at_least} tokens. Please reduce the length of the "
        "messages.",
        param="messages",
        code="context_length_exceeded",
    )


@contextlib.contextmanager
def budget(cpu_s: float | None, max_tokens: int | None = None) -> Iterator[None]:
    """Within this block (one request's render + tokenize, in one thread), BPE-encoding new
    text stops with a 413 once the thread has used ``cpu_s`` of CPU since the block began,
    and with a 400 once the prompt has more than ``max_tokens`` tokens (it could not fit;
    None: no token bound). Cached segments cost nothing against it."""
    state = (
        _Budget(cpu_s, time.thread_time() + cpu_s, max_tokens)
        if cpu_s is not None and cpu_s > 0
        else None
    )
    token = _BUDGET.set(state)
    try:
        yield
    finally:
        _BUDGET.reset(token)


@contextlib.contextmanager
def inline(max_uncached_chars: int) -> Iterator[None]:
    """Within this block, tokenizing raises ``NeedsThread`` instead of BPE-encoding more
    than ``max_uncached_chars`` of uncached text, so an event loop can tokenize a cached
    prompt in place (microseconds) and hand only real work to a thread."""
    token = _INLINE_BUDGET.set(max_uncached_chars)
    try:
        yield
    finally:
        _INLINE_BUDGET.reset(token)


@contextlib.contextmanager
def cache_scope(cache_salt: str | None) -> Iterator[None]:
    """Within this block, segment-cache entries are those of the ``cache_salt`` scope:
    text cached under another salt is a miss here, exactly as on a replica."""
    token = _CACHE_SCOPE.set(cache_scope_seed(cache_salt))
    try:
        yield
    finally:
        _CACHE_SCOPE.reset(token)


class SegmentTokenizer:
    """``tokenizer.encode`` through the segment cache when it is on and provably equivalent
    (``enabled``), else the tokenizer itself. Thread-safe: the LRU is shared by threads."""

    def __init__(self, tokenizer: Any, *, segment_cache: bool, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None
        )
        self.cache: OrderedDict[int, array[int]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.cache_tokens = 0
        self.max_tokens = int(max_tokens)
        self.hits = 0
        self.misses = 0
        self._added: dict[str, int] = {}
        self._added_text: dict[int, str] = {}
        self._split_re: re.Pattern[str] | None = None
        self._special_adds_nothing = False
        self._chunkable = False  # new text can be cut at _SAFE_CUT (see _chunk_safe)
        self.requested = segment_cache
        # The one encode hook: new segments' BPE (router/prompt/fast_encode.py).
        self._encode_plain: PlainEncoder | None = None
        self.encoder = REFERENCE
        if segment_cache and self._backend is not None:
            self._encode_plain, self.encoder = plain_encoder(self._backend)
        reason = self._split_safe() if segment_cache else "disabled"
        self.enabled = reason is None
        if segment_cache and reason is not None:
            log.warning("segment cache disabled for this tokenizer: %s", reason)

    def encode(self, text: str, add_special_tokens: bool) -> TokenIds:
        if self.enabled and (not add_special_tokens or self._special_adds_nothing):
            return self._encode_split(text, use_cache=True)
        return self._encode_whole(text, add_special_tokens)

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # lone surrogates cannot be turned into UTF-8
            raise error("the prompt is not valid Unicode text") from None

    def _split_safe(self) -> str | None:
        """None if tokenizing segment by segment is exactly the whole-text tokenization for
        this tokenizer, else the reason it is not."""
        backend = self._backend
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return "not a fast (Rust) tokenizer"
        for tid, tok in backend.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
                return f"added token {tok.content!r} has lstrip/rstrip/single_word/normalized"
            if not tok.content:
                return "empty added token"
            self._added[tok.content] = tid
            self._added_text[tid] = tok.content
        if getattr(self.tokenizer, "split_special_tokens", False):
            return "split_special_tokens is set"
        spec: dict[str, Any] = {}
        try:
            for key in ("normalizer", "pre_tokenizer"):
                component = getattr(backend, key, None)
                spec[key] = None if component is None else json.loads(component.__getstate__())
        except Exception:
            return "cannot inspect the tokenizer"

        # Pre-tokenizers/normalizers that look at where the *whole* text starts (a prefix
        # space, Metaspace "first") would treat each segment as a start.
        def walk(node: Any) -> Iterator[Any]:
            if isinstance(node, dict):
                yield node
                for v in node.values():
                    yield from walk(v)
            elif isinstance(node, list):
                for v in node:
                    yield from walk(v)

        for key in ("normalizer", "pre_tokenizer"):
            for node in walk(spec.get(key)):
                if node.get("add_prefix_space") or node.get("prepend_scheme") not in (
                    None,
                    "never",
                ):
                    return f"{key} depends on the start of the text"
                if node.get("type") in ("Prepend",):
                    return f"{key} prepends text"
        if not self._added:
            return "no added tokens to split on"
        alternatives = sorted(self._added, key=len, reverse=True)  # leftmost-longest
        self._split_re = re.compile("|".join(re.escape(t) for t in alternatives))
        # add_special_tokens=True can use the segment path only if it adds nothing.
        probe = "a<|probe|> b\n"
        self._special_adds_nothing = (
            backend.encode(probe, add_special_tokens=True).ids
            == backend.encode(probe, add_special_tokens=False).ids
        )
        # Self-check on text that crosses every kind of boundary.
        sample = "".join(f"x {t}\n {t}é\u0301 " for t in alternatives) + "  end"
        if list(self._encode_split(sample, use_cache=False)) != list(
            backend.encode(sample, add_special_tokens=False).ids
        ):
            return "segment tokenization differs from whole-text tokenization"
        self._chunkable = self._chunk_safe(spec)
        if self._chunkable and self.encoder == FAST and self._encode_plain is not None:
            self._encode_plain = _cut_long(self._encode_plain)
        return None

    def _chunk_safe(self, spec: dict[str, Any]) -> bool:
        """Whether ``_SAFE_CUT`` is a token boundary for this tokenizer: its normalizer and
        pre-tokenizer are those the cut was proven for, and a self-check agrees."""
        normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer") or {}
        if normalizer not in (None, {"type": "NFC"}):
            return False
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return False
        split, byte_level = steps
        if not (
            split.get("type") == "Split"
            and split.get("pattern") == {"Regex": _CHUNKABLE_SPLIT}
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex")
            and not byte_level.get("add_prefix_space")
        ):
            return False
        assert self._backend is not None
        sample = "Ab1 2 é\u0301 x\n y  z!! ?? 'll 中文，文。 \t end " * 3
        whole = self._backend.encode(sample, add_special_tokens=False).ids
        cut, pos = [], 0
        for m in _SAFE_CUT.finditer(sample):
            cut.extend(self._backend.encode(sample[pos : m.end()], add_special_tokens=False).ids)
            pos = m.end()
        cut.extend(self._backend.encode(sample[pos:], add_special_tokens=False).ids)
        return bool(cut == whole)

    def _encode_split(
        self,
        text: str,
        *,
        use_cache: bool,
        base_tokens: int = 0,
        cuts: list[tuple[int, int]] | None = None,
    ) -> array[int]:
        """``text``'s ids, segment by segment. ``base_tokens``: tokens before ``text`` in the
        prompt (a cached prefix), counted against the token bound. ``cuts``: if given, gets
        (characters, tokens) of ``text`` after each added token: where the prompt can be cut
        with its ids cut alike."""
        assert self._split_re is not None and self._backend is not None
        pieces = self.pieces(text)
        keys: list[int] = []
        found: dict[int, Sequence[int]] = {}
        missing: dict[int, str] = {}
        cache = self.cache
        seed = _CACHE_SCOPE.get()
        for p in pieces:
            if isinstance(p, int):
                continue
            try:
                key = xxhash.xxh3_128_intdigest(p.encode("utf-8"), seed)
            except UnicodeEncodeError:
                raise error("the prompt is not valid Unicode text") from None
            keys.append(key)
            if key in found or key in missing:
                continue
            hit = cache.get(key) if use_cache else None
            if hit is not None:
                found[key] = hit
            else:
                missing[key] = p
        if use_cache and found:
            with self._cache_lock:
                for key in found:
                    if key in cache:
                        cache.move_to_end(key)
                self.hits += len(found)
        budget = _INLINE_BUDGET.get()
        if missing:
            state = _BUDGET.get()
            if state is not None:  # this prompt's tokens so far: its cached segments
                state.tokens = base_tokens + sum(len(found[k]) for k in keys if k in found)
            if budget is not None and sum(map(len, missing.values())) > budget:
                raise NeedsThread
            assert self._encode_plain is not None
            segs = list(missing.values())
            if state is not None and sum(map(len, segs)) > CHUNK_CHARS:
                all_ids: list[Sequence[int]] = [self._encode_budgeted(seg, state) for seg in segs]
            else:
                all_ids = self._encode_plain(segs)
            for key, got in zip(missing, all_ids, strict=True):
                ids = got if isinstance(got, array) else array("I", got)  # ints packed once
                found[key] = ids
                if use_cache:
                    self._put(key, ids)
            if use_cache:
                self.misses += len(missing)
        out = array("I")  # cached segments are arrays: extending copies memory, not ints
        k = 0
        if cuts is None:
            for p in pieces:
                if isinstance(p, int):
                    out.append(p)
                else:
                    out.extend(found[keys[k]])
                    k += 1
            return out  # an array all the way to block hashing: no Python int per token
        pos = 0
        added_text = self._added_text
        for p in pieces:
            if isinstance(p, int):
                out.append(p)
                pos += len(added_text[p])
                cuts.append((pos, len(out)))
            else:
                out.extend(found[keys[k]])
                pos += len(p)
                k += 1
        return out

    def _encode_budgeted(self, text: str, state: _Budget) -> list[int]:
        """``text``'s ids, encoded piece by piece with ``state`` checked between pieces.
        Pieces are cut at ``_SAFE_CUT`` (exact) when the tokenizer is Qwen2's kind; a longer
        stretch with no such cut (one run of spaces, letters, symbols) can only be encoded
        whole, which no check can interrupt: it is refused up front when its cost,
        projected from encoding its first CHUNK_CHARS, does not fit what is left of the
        budget (``_whole_cost``). While its first pieces project more tokens than the
        context holds, more of it is encoded in arbitrary pieces to find that out (those
        ids are thrown away)."""
        assert self._encode_plain is not None
        plain = self._encode_plain

        def encode(text: str) -> Sequence[int]:
            return plain([text])[0]

        ids: list[int] = []
        for piece, exact in self._pieces(text):
            if exact:
                ids.extend(encode(piece))
                self._check(state, len(ids), len(text))
                continue
            probed = 0
            t0 = time.thread_time()
            for at in range(0, len(piece), CHUNK_CHARS):
                probed += len(encode(piece[at : at + CHUNK_CHARS]))
                # A cut can split what whole-text BPE merges: allow a few tokens per cut.
                self._check(state, len(ids) + probed - 4 * (at // CHUNK_CHARS), len(text))
                done = min(len(piece), at + CHUNK_CHARS)
                if state.max_tokens is None or (
                    state.tokens + len(ids) + probed * len(piece) / done <= state.max_tokens
                ):
                    break  # its tokens fit (as far as this tells): only its cost is left
            rate = (time.thread_time() - t0) / done  # CPU per character, in pieces
            if time.thread_time() + _whole_cost(rate, len(piece)) > state.deadline:
                raise over_budget(state.cpu_s, len(text))
            ids.extend(encode(piece))
            self._check(state, len(ids), len(text))
        state.tokens += len(ids)
        return ids

    def _pieces(self, text: str) -> Iterator[tuple[str, bool]]:
        """``text`` as consecutive (piece, cut exactly) of about CHUNK_CHARS each."""
        if not self._chunkable:
            yield text, False
            return
        pos, n = 0, len(text)
        while n - pos > CHUNK_CHARS:
            target = pos + CHUNK_CHARS
            m = _SAFE_CUT.search(text, target, min(n, target + 4 * CHUNK_CHARS))
            if m is None:  # a long stretch with no boundary: up to the next one, or the end
                m = _search_cut(text, target)
                if m is None:
                    break
                yield text[pos : m.end()], False
            else:
                yield text[pos : m.end()], True
            pos = m.end()
        if pos < n:
            yield text[pos:], n - pos <= CHUNK_CHARS

    @staticmethod
    def _check(state: _Budget, tokens: int, chars: int) -> None:
        if state.max_tokens is not None and state.tokens + tokens > state.max_tokens:
            raise over_context(state.max_tokens, state.tokens + tokens)
        if time.thread_time() > state.deadline:
            raise over_budget(state.cpu_s, chars)

    def pieces(self, text: str) -> list[str | int]:
        """``text`` cut at the added tokens: segment text, or an added token's id (in order;
        their ids concatenated are the text's ids)."""
        assert self._split_re is not None
        added = self._added
        pieces: list[str | int] = []
        pos = 0
        for m in self._split_re.finditer(text):
            if m.start() > pos:
                pieces.append(text[pos : m.start()])
            pieces.append(added[m.group()])
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces

    # -- one segment at a time, for the lazy tail (router/prompt/lazy.py) -------------------
    @property
    def backend(self) -> Any:
        """The Rust ``tokenizers.Tokenizer``, or None for a slow tokenizer."""
        return self._backend

    def split_path(self, add_special_tokens: bool) -> bool:
        """Whether ``encode`` takes the segment path for this flag (else the whole text)."""
        return self.enabled and (not add_special_tokens or self._special_adds_nothing)

    def token_text(self, token_id: int) -> str:
        """The text of an added token (one ``pieces`` returned as its id)."""
        return self._added_text[token_id]

    def _key(self, piece: str) -> int:
        try:
            return xxhash.xxh3_128_intdigest(piece.encode("utf-8"), _CACHE_SCOPE.get())
        except UnicodeEncodeError:
            raise error("the prompt is not valid Unicode text") from None

    def cached_ids(self, piece: str) -> array[int] | None:
        """The cached ids of one segment in this cache scope, or None (counted as a hit)."""
        key = self._key(piece)
        hit = self.cache.get(key)
        if hit is not None:
            with self._cache_lock:
                if key in self.cache:
                    self.cache.move_to_end(key)
                self.hits += 1
        return hit

    def encode_piece(self, text: str, *, store: bool) -> list[int]:
        """BPE-encode text with no added token in it (a segment or part of one), with the
        one encode hook (safe in a worker thread: it never holds the GIL for long)."""
        assert self._encode_plain is not None
        ids = list(self._encode_plain([text])[0])
        if store:
            self.store(text, ids)
        return ids

    def store(self, piece: str, ids: Sequence[int]) -> None:
        """Cache ``ids`` as the segment ``piece``'s in this scope (a miss, counted)."""
        self._put(self._key(piece), list(ids))
        self.misses += 1

    def encode_cuts(self, text: str, base_tokens: int, cuts: list[tuple[int, int]]) -> array[int]:
        """``encode(text, False)`` on the segment path, noting in ``cuts`` where an added
        token ends (see ``_encode_split``); ``text`` follows ``base_tokens`` cached ones."""
        return self._encode_split(text, use_cache=True, base_tokens=base_tokens, cuts=cuts)

    def contained_added(self) -> bool:
        """Whether an added token holds another one inside it (then a cut after an added
        token in a prompt's first part need not be one in the whole prompt)."""
        added = list(self._added)
        return any(a != b and a in b for a in added for b in added)

    def encode_cached(self, text: str) -> array[int]:
        """``encode(text, False)`` on the segment path (cached segments looked up)."""
        return self._encode_split(text, use_cache=True)

    def _put(self, key: int, ids: Sequence[int]) -> None:
        n = len(ids)
        if n == 0 or n > self.max_tokens // 4:  # one segment may not flush the cache
            return
        # Kept as given when already an array: nothing changes one once it is encoded.
        stored = ids if isinstance(ids, array) else array("I", ids)
        with self._cache_lock:
            old = self.cache.pop(key, None)
            if old is not None:
                self.cache_tokens -= len(old)
            self.cache[key] = stored
            self.cache_tokens += n
            while self.cache_tokens > self.max_tokens and self.cache:
                _, evicted = self.cache.popitem(last=False)
                self.cache_tokens -= len(evicted)

    def info(self) -> dict[str, int]:
        """Segment-cache counters (entries, cached tokens, budget, hits, misses)."""
        return {
            "entries": len(self.cache),
            "tokens": self.cache_tokens,
            "max_tokens": self.max_tokens,
            "hits": self.hits,
            "misses": self.misses,
        }

    def clear(self) -> None:
        with self._cache_lock:
            self.cache.clear()
            self.cache_tokens = 0
