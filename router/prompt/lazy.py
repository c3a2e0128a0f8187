"""The lazy tail: a rendered prompt's leading token ids now, the rest later, exactly.

The gateway routes on a prompt's chained block hashes. A block that no candidate replica holds
can only be followed by blocks none holds, so the decision needs the ids up to a little past
the longest match, not all of them. ``head`` tokenizes the segments the segment cache holds
plus the start of the first new segment (cut where tokenizing in two pieces is provably the
same as in one, see ``cut_rule``), and returns a ``Head`` whose ``finish`` computes the full
ids - the same array ``SegmentTokenizer.encode`` gives - in a worker thread.

Why a cut is exact: a fast tokenizer runs normalizer -> pre-tokenizer -> model (BPE, per
pre-token) and, with ``add_special_tokens=False``, no post-processor ids. For the
pre-tokenizers in ``_SAFE_PATTERNS`` (the GPT-4-style split regexes of Qwen2/Qwen3 and
Llama 3, then ByteLevel without its own regex) and an NFC (or no) normalizer, a position ``c``
with a letter at ``c-1``, a space at ``c`` and a letter at ``c+1`` is a pre-token boundary
that no match reads across: every alternative that can match a letter is a letter run or a
fixed-length contraction, so the match ending at ``c-1`` ends there with or without what
follows, the regex has no look-behind, so matching from ``c`` sees only ``text[c:]``, and NFC
never composes across an ASCII space. So ``encode(t) == encode(t[:c]) + encode(t[c:])``;
tests/test_lazy_tail.py checks it on generated text, and ``cut_rule`` self-checks at start.
"""

from __future__ import annotations

import functools
import json
import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.prompt.fields import error
from router.prompt.segments import SegmentTokenizer

log = logging.getLogger(__name__)

# Split regexes for which the cut rule above was checked by hand (and by the property test).
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = _QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_SAFE_PATTERNS = frozenset({_QWEN2, _LLAMA3})

HEAD_CHARS_PER_BLOCK = 4
"""The head reads the first new segment this many characters per token of the block size at
a time (~a block of English), from exact cut to exact cut, until it has more than a block of
new tokens: then the block that straddles the cached text and the new one, which no replica
holds in the common case, is in the head, and so is the first block after it."""


def cut_rule(backend: Any) -> str | None:
    """None if ``find_cut``'s positions are exact cuts for this (``tokenizers``) backend,
    else the reason they are not known to be."""
    try:
        normalizer = backend.normalizer
        spec_n = None if normalizer is None else json.loads(normalizer.__getstate__())
        spec_p = json.loads(backend.pre_tokenizer.__getstate__())
    except Exception:
        return "cannot inspect the tokenizer"
    if spec_n is not None and spec_n.get("type") != "NFC":
        return f"normalizer {spec_n.get('type')!r}"
    steps = spec_p.get("pretokenizers") if spec_p.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return "pre-tokenizer is not Split + ByteLevel"
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or (split.get("pattern") or {}).get("Regex") not in _SAFE_PATTERNS
        or split.get("behavior") != "Isolated"
        or split.get("invert")
    ):
        return "split pattern not known to cut safely"
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return "ByteLevel step splits or prefixes by itself"
    sample = "Hello wörld it's 12 cats\u0301 and  dogs,\n\tthe end  ok"
    whole = backend.encode(sample, add_special_tokens=False).ids
    for c in cuts(sample):
        left = backend.encode(sample[:c], add_special_tokens=False).ids
        right = backend.encode(sample[c:], add_special_tokens=False).ids
        if left + right != whole:
            return "self-check: a cut changes the tokens"
    return None


def find_cut(text: str, start: int) -> int | None:
    """The first position ``c >= start`` with a letter before it, then a space and a
    letter: ``encode(text) == encode(text[:c]) + encode(text[c:])`` (see the module doc)."""
    at = max(1, start)
    n = len(text)
    while True:
        c = text.find(" ", at)
        if c < 0 or c + 1 >= n:
            return None
        if text[c - 1].isalpha() and text[c + 1].isalpha():  # str.isalpha is \p{L}
            return c
        at = c + 1


def cuts(text: str) -> list[int]:
    """Every exact cut of ``text`` (tests and the self-check)."""
    out: list[int] = []
    c = find_cut(text, 1)
    while c is not None:
        out.append(c)
        c = find_cut(text, c + 1)
    return out


@dataclass(frozen=True, slots=True)
class Head:
    """The leading ids of a prompt (an exact prefix of its full ids) and how to get the rest.

    ``finish()`` returns the full ids and stores the first new segment whole in the segment
    cache (the next turn finds it); it may run in another thread, under the same cache scope.
    ``rest_chars``: characters of the rendered prompt not yet tokenized."""

    ids: array[int]
    finish: Callable[[], array[int]]
    rest_chars: int

    def estimated_tokens(self) -> int:
        """A stand-in for the untokenized rest's token count, at least 1 (the rest is
        non-empty text). Routing adds it to every candidate alike."""
        return self.rest_chars // 4 + 1


def head(seg: SegmentTokenizer, text: str, block_size: int, min_rest_chars: int = 0) -> Head | None:
    """``text``'s ids up to a block and a little more into its first long segment the cache
    does not hold, or None when that would be the whole prompt anyway (everything cached,
    or no exact cut in it) or when no more than ``min_rest_chars`` are left from that
    segment on (cheaper to encode now than to defer): tokenize it the ordinary way then.
    New segments too short to cut (an earlier short answer) are encoded here and cached."""
    min_new_chars = HEAD_CHARS_PER_BLOCK * block_size
    ids = array("I")
    pos = 0  # where the current piece starts in text
    for p in seg.pieces(text):
        if isinstance(p, int):
            ids.append(p)
            pos += len(seg.token_text(p))
            continue
        hit = seg.cached_ids(p)
        if hit is not None:
            ids.extend(hit)
            pos += len(p)
            continue
        if len(text) - pos <= min_rest_chars:
            return None
        # Encode from one exact cut to the next until a block's worth of new tokens.
        first: list[int] = []
        c = 0
        while len(first) <= block_size:
            nxt = find_cut(p, c + min_new_chars)
            if nxt is None:
                break
            first += seg.encode_piece(p[c:nxt], store=False)
            c = nxt
        if c == 0:  # no cut: a short new segment is encoded whole, a long one is not lazy
            if len(p) > 8 * min_new_chars:
                return None
            ids.extend(seg.encode_piece(p, store=True))
            pos += len(p)
            continue
        check_text(text[pos:])  # what the full encode would refuse is refused now
        ids.extend(first)
        done = array("I", ids)
        rest = text[pos + len(p) :]
        finish = functools.partial(_finish, seg, done, p, first, c, rest)
        return Head(done, finish, len(text) - pos - c)
    return None


def _finish(
    seg: SegmentTokenizer, head: array[int], piece: str, first: list[int], cut: int, rest: str
) -> array[int]:
    """The full ids: the head, the cut segment's second part, then the segments after it;
    the cut segment is cached whole (the next turn repeats it)."""
    whole = array("I", first)
    whole.extend(seg.encode_piece(piece[cut:], store=False))
    seg.store(piece, whole)
    out = array("I", head)
    out.extend(whole[len(first) :])
    if rest:
        out.extend(seg.encode_cached(rest))
    return out


def check_text(text: str) -> None:
    """The segment path's refusal of text that is not valid Unicode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error("the prompt is not valid Unicode text") from None
