"""The segment-cache tokenizer: a prompt's ids as the concatenation of its segments' ids.

Hugging Face tokenizers cut the text at added tokens (``<|im_start|>``, ...) before
normalising and running BPE, so a rendered prompt's ids are the concatenation of each
segment's ids. The ids of each segment are kept in an LRU keyed by the XXH3-128 of its UTF-8
bytes, seeded by the request's cache-salt scope (``router.prompt.scope``), and bounded by the
number of cached tokens, so a repeated 3,000-token system prompt costs a hash and a dict lookup. The
split is only used when it is provably equivalent for the tokenizer (see ``_split_safe``);
otherwise the whole text is encoded. New text is encoded through ``router.prompt.chunks``
within the request's budget.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import xxhash

import router.prompt.chunks as chunks
import router.prompt.scope as scope
from router.prompt.fast_encode import FAST, REFERENCE, PlainEncoder, plain_encoder
from router.prompt.fields import TokenIds, error

log = logging.getLogger(__name__)  # a child of "router.prompt", the logger it used to be

DEFAULT_SEGMENT_CACHE_TOKENS = 2_000_000
"""Token budget of the segment cache (ids are stored as 4-byte ints: ~8 MB plus per-entry
overhead)."""


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
        self._split_lead: str | None = None  # the first character of every added token
        self._special_adds_nothing = False
        self._chunkable = False  # new text can be cut at chunks.SAFE_CUT (see _chunk_safe)
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
        leads = {t[0] for t in alternatives if t}
        self._split_lead = leads.pop() if len(leads) == 1 and all(alternatives) else None
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
            self._encode_plain = chunks.cut_long(self._encode_plain)
        return None

    def _chunk_safe(self, spec: dict[str, Any]) -> bool:
        """Whether ``chunks.SAFE_CUT`` is a token boundary for this tokenizer: its normalizer and
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
            and split.get("pattern") == {"Regex": chunks.CHUNKABLE_SPLIT}
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
        for m in chunks.SAFE_CUT.finditer(sample):
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
        out: array[int] | None = None,
        start: int = 0,
    ) -> array[int]:
        """``text[start:]``'s ids, segment by segment. ``base_tokens``: tokens before it in
        the prompt (a cached prefix), counted against the token bound. ``cuts``: if given,
        gets (characters, tokens) of ``text[start:]`` after each added token: where the
        prompt can be cut with its ids cut alike."""
        assert self._split_re is not None and self._backend is not None
        pieces = self.pieces(text, start)
        keys: list[int] = []
        found: dict[int, Sequence[int]] = {}
        missing: dict[int, str] = {}
        cache = self.cache
        seed = scope.CACHE_SCOPE.get()
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
        budget = scope.INLINE_BUDGET.get()
        if missing:
            state = scope.BUDGET.get()
            if state is not None:  # this prompt's tokens so far: its cached segments
                state.tokens = base_tokens + sum(len(found[k]) for k in keys if k in found)
            if budget is not None and sum(map(len, missing.values())) > budget:
                raise scope.NeedsThread
            assert self._encode_plain is not None
            segs = list(missing.values())
            if state is not None and sum(map(len, segs)) > chunks.CHUNK_CHARS:
                plain = self._encode_plain

                def encode(text: str) -> Sequence[int]:
                    return plain([text])[0]

                all_ids: list[Sequence[int]] = [
                    chunks.encode_budgeted(encode, seg, state, self._chunkable) for seg in segs
                ]
            else:
                all_ids = self._encode_plain(segs)
            for key, got in zip(missing, all_ids, strict=True):
                ids = got if isinstance(got, array) else array("I", got)  # ints packed once
                found[key] = ids
                if use_cache:
                    self._put(key, ids)
            if use_cache:
                self.misses += len(missing)
        # Cached segments are arrays: extending copies memory, not ints. ``out``: the array
        # to append to (a prefix state's ids: no second copy of the new ids).
        if out is None:
            out = array("I")
        start = len(out)
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
                cuts.append((pos, len(out) - start))
            else:
                out.extend(found[keys[k]])
                pos += len(p)
                k += 1
        return out

    def pieces(self, text: str, start: int = 0) -> list[str | int]:
        """``text[start:]`` cut at the added tokens: segment text, or an added token's id (in
        order; their ids concatenated are the text's ids). The pattern is literal tokens:
        searching from ``start`` finds what searching the slice would, without the copy."""
        assert self._split_re is not None
        added = self._added
        pieces: list[str | int] = []
        pos = start
        lead = self._split_lead
        if lead is None:
            matches: Iterable[re.Match[str]] = self._split_re.finditer(text, start)
        else:
            matches = self._lead_matches(text, lead, start)
        for m in matches:
            if m.start() > pos:
                pieces.append(text[pos : m.start()])
            pieces.append(added[m.group()])
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces

    def _lead_matches(self, text: str, lead: str, start: int = 0) -> Iterator[re.Match[str]]:
        """``finditer``'s matches, found by ``str.find`` of the character every added token
        starts with (a SIMD scan; the regex engine's search steps a character at a time):
        a match can start nowhere else, and after one the search resumes at its end."""
        assert self._split_re is not None
        find, match = text.find, self._split_re.match
        i = find(lead, start)
        while i >= 0:
            m = match(text, i)
            if m is None:
                i = find(lead, i + 1)
            else:
                yield m
                i = find(lead, m.end())

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
            return xxhash.xxh3_128_intdigest(piece.encode("utf-8"), scope.CACHE_SCOPE.get())
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

    def encode_cuts(
        self, text: str, cuts: list[tuple[int, int]], out: array[int], start: int = 0
    ) -> array[int]:
        """``encode(text[start:], False)`` on the segment path appended to ``out`` (whose ids,
        a cached prefix's, precede ``text[start:]``), noting in ``cuts`` where an added token
        ends (see ``_encode_split``; counted from ``start``)."""
        return self._encode_split(
            text, use_cache=True, base_tokens=len(out), cuts=cuts, out=out, start=start
        )

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
