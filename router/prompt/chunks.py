"""Cutting new text into pieces whose ids concatenate to the whole text's, and encoding it
piece by piece within one request's budget (``router.prompt.scope``).

New text is BPE-encoded in pieces of about CHUNK_CHARS, the budget checked between them, so
one request cannot hold a tokenizer thread for seconds. Pieces are cut where the whole-text
tokenization provably has a token boundary too (``SAFE_CUT``), so the ids are exact.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator, Sequence

from router.prompt.fast_encode import FAST_MAX_CHARS, PlainEncoder
from router.prompt.scope import Budget, over_budget, over_context

CHUNK_CHARS = 32_768
# Qwen2/Qwen3's pre-tokenizer (Split on this regex, Isolated; then ByteLevel without its own
# regex; NFC or no normalizer). For it, just before a space that follows a non-space
# character is always a pre-token boundary: no alternative of the regex runs from a
# non-space character into a following space (words are letters, numbers single
# characters, symbol runs stop at whitespace), the regex looks only ahead, and a space
# composes with nothing under NFC. Likewise before CJK punctuation after a CJK ideograph.
CHUNKABLE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
SAFE_CUT = re.compile(r"\S(?= )|[\u4e00-\u9fff](?=[\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f])")


SEARCH_WINDOW = 1 << 16


def search_cut(text: str, pos: int) -> re.Match[str] | None:
    """``SAFE_CUT.search(text, pos)``, a window of characters at a time: one regex call over
    megabytes with no cut (3.9M spaces) held the GIL for 70-150 ms, and the event loop with it;
    between windows it can change hands. A window reaches one character past its end, so the
    lookahead of a cut at its last position is seen."""
    n = len(text)
    while pos < n:
        m = SAFE_CUT.search(text, pos, min(n, pos + SEARCH_WINDOW + 1))
        if m is not None:
            return m
        pos += SEARCH_WINDOW
    return None


def fast_pieces(text: str, limit: int = FAST_MAX_CHARS) -> list[str]:
    """``text`` cut at ``SAFE_CUT`` (exact for a chunkable tokenizer) into pieces of at most
    ``limit`` characters where the last ``limit // 16`` characters before the limit hold a
    cut; a piece is longer only where they do not (up to the next cut, or the end)."""
    out: list[str] = []
    pos, n = 0, len(text)
    while n - pos > limit:
        m = SAFE_CUT.search(text, pos + limit - limit // 16, pos + limit)
        if m is None:
            m = search_cut(text, pos + limit)
            if m is None:
                break
        out.append(text[pos : m.end()])
        pos = m.end()
    out.append(text[pos:])
    return out


def cut_long(encode: PlainEncoder) -> PlainEncoder:
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


def whole_cost(rate: float, chars: int) -> float:
    """CPU seconds to BPE-encode ``chars`` characters with no cut whole, from ``rate`` (CPU
    per character encoding CHUNK_CHARS pieces of them). Whole is dearer per character the
    longer the run (BPE merges over one pre-token: measured with fastokens on runs of
    spaces, letters, newlines, symbols, digits and CJK, 2M characters cost 1.6-1.9x their
    32k pieces): this over-estimates that growth a little, so a run that is refused would
    not have fit, and one that is encoded fits."""
    return rate * chars * (1.0 + 0.15 * math.log2(max(1.0, chars / CHUNK_CHARS)))


def pieces(text: str, chunkable: bool) -> Iterator[tuple[str, bool]]:
    """``text`` as consecutive (piece, cut exactly) of about CHUNK_CHARS each (one inexact
    piece when the tokenizer is not ``chunkable``)."""
    if not chunkable:
        yield text, False
        return
    pos, n = 0, len(text)
    while n - pos > CHUNK_CHARS:
        target = pos + CHUNK_CHARS
        m = SAFE_CUT.search(text, target, min(n, target + 4 * CHUNK_CHARS))
        if m is None:  # a long stretch with no boundary: up to the next one, or the end
            m = search_cut(text, target)
            if m is None:
                break
            yield text[pos : m.end()], False
        else:
            yield text[pos : m.end()], True
        pos = m.end()
    if pos < n:
        yield text[pos:], n - pos <= CHUNK_CHARS


def check(state: Budget, tokens: int, chars: int) -> None:
    """Raise once ``tokens`` more would overflow the context or the CPU budget is spent."""
    if state.max_tokens is not None and state.tokens + tokens > state.max_tokens:
        raise over_context(state.max_tokens, state.tokens + tokens)
    if time.thread_time() > state.deadline:
        raise over_budget(state.cpu_s, chars)


def encode_budgeted(
    encode: Callable[[str], Sequence[int]], text: str, state: Budget, chunkable: bool
) -> list[int]:
    """``text``'s ids, encoded piece by piece with ``state`` checked between pieces.
    Pieces are cut at ``SAFE_CUT`` (exact) when the tokenizer is Qwen2's kind (``chunkable``);
    a longer stretch with no such cut (one run of spaces, letters, symbols) can only be
    encoded whole, which no check can interrupt: it is refused up front when its cost,
    projected from encoding its first CHUNK_CHARS, does not fit what is left of the
    budget (``whole_cost``). While its first pieces project more tokens than the
    context holds, more of it is encoded in arbitrary pieces to find that out (those
    ids are thrown away)."""
    ids: list[int] = []
    for piece, exact in pieces(text, chunkable):
        if exact:
            ids.extend(encode(piece))
            check(state, len(ids), len(text))
            continue
        probed = 0
        t0 = time.thread_time()
        for at in range(0, len(piece), CHUNK_CHARS):
            probed += len(encode(piece[at : at + CHUNK_CHARS]))
            # A cut can split what whole-text BPE merges: allow a few tokens per cut.
            check(state, len(ids) + probed - 4 * (at // CHUNK_CHARS), len(text))
            done = min(len(piece), at + CHUNK_CHARS)
            if state.max_tokens is None or (
                state.tokens + len(ids) + probed * len(piece) / done <= state.max_tokens
            ):
                break  # its tokens fit (as far as this tells): only its cost is left
        rate = (time.thread_time() - t0) / done  # CPU per character, in pieces
        if time.thread_time() + whole_cost(rate, len(piece)) > state.deadline:
            raise over_budget(state.cpu_s, len(text))
        ids.extend(encode(piece))
        check(state, len(ids), len(text))
    state.tokens += len(ids)
    return ids
