"""The BPE behind the segment path (router/prompt/segments.py): text holding no added token,
encoded without special tokens.

Hugging Face ``tokenizers`` is the reference. ``fastokens`` (``pip install
'prefix-router[fast-tokenizer]'``) reads the same tokenizer.json and encodes new text ~50-100x
faster here (docs/performance.md); it is used only if it is installed, not turned off with
``PREFIX_ROUTER_FAST_TOKENIZER=0``, and encodes a self-check corpus (multilingual text,
combining marks, emoji, whitespace runs, code, control characters, a seeded random mix)
exactly as the reference does. On any disagreement the reference is used, with a warning.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

ENV = "PREFIX_ROUTER_FAST_TOKENIZER"  # "0": always Hugging Face's
REFERENCE = "tokenizers"
FAST = "fastokens"

PlainEncoder = Callable[[list[str]], list[Sequence[int]]]

_SAMPLES = (
    "Hello! What is a KV cache?",
    "I'm you're he'll they'd we've it's 'quoted' \"dq\" HELLO World hElLo",
    "人工智能正在改变世界。東京は日本の首都です。カタカナとひらがな。한국어 문장입니다.",
    "مرحبا بالعالم ١٢٣٤٥ שלום עולם नमस्ते दुनिया สวัสดีชาวโลก Привет, ёжик Γειά σου",
    "Tiếng Việt có dấu; café cafe\u0301 naïve Å Ångström ß ﬁ ＡＢＣ e\u0301\u0301 \u1100\u1161",
    "emoji 😀😃 👩\u200d👩\u200d👧\u200d👦 👍🏽 🇺🇸🇯🇵 ❤️\u200d🔥 🏳️\u200d🌈 ✨🔥💯",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}\nfor (int i = 0; i < n; ++i) { s += a[i]; }',
    "   lead",
    "trail   ",
    "\t\ttabs\t\t",
    "\n\n\n\nlines\n\n",
    " " * 50,
    "\n" * 40,
    " \n \n \n ",
    "a" + " " * 17 + "b",
    "\r\n\r\nCRLF\r\n",
    "\u00a0nbsp\u00a0\u00a0 \u3000ideo\u3000 \u2028\u2029 zero\u200bwidth\u200c\u200d \ufeffBOM",
    "control\x00\x01\x1f\x7f 1234567890123456789012345 3.14159 1e-10 0x1F -42",
    "https://example.com/path?q=1&r=2#frag user@example.com",
)
_RANGES = (
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x300, 0x36F),
    (0x370, 0x4FF),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0xE00, 0xE7F),
    (0x1100, 0x11FF),
    (0x2000, 0x206F),
    (0x3040, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF),
    (0x0, 0x1F),
)
_SPACES = (" ", "  ", "\n", "\t", "\n\n", " \n", "\r\n", "   \n  ")


def self_check_corpus(n_random: int = 400, seed: int = 16) -> list[str]:
    """The fixed samples, then ``n_random`` seeded mixes of them, whitespace and code points
    from many scripts (no lone surrogates: segments are valid UTF-8 by then)."""
    rng = random.Random(seed)
    out = list(_SAMPLES)
    for _ in range(n_random):
        parts = []
        for _ in range(rng.randrange(1, 24)):
            r = rng.random()
            if r < 0.25:
                parts.append(rng.choice(_SPACES))
            elif r < 0.5:
                parts.append(rng.choice(_SAMPLES)[: rng.randrange(1, 40)])
            else:
                lo, hi = rng.choice(_RANGES)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randrange(1, 12))))
        out.append("".join(parts))
    return out


def reference_encoder(backend: Any) -> PlainEncoder:
    """Hugging Face ``tokenizers``, always through ``encode_batch_fast``: the same ids, and
    without the offsets ``encode`` computes it took half the time (2.5 against 5.9 ms per
    1,000 tokens of prose here), one segment or many."""

    def encode(segments: list[str]) -> list[Sequence[int]]:
        return [e.ids for e in backend.encode_batch_fast(segments, add_special_tokens=False)]

    return encode


# fastokens holds the GIL while it encodes (tokenizers' batch call releases it): a segment
# longer than this goes to the reference, so a worker thread never stalls the event loop
# for more than a few ms (16k characters: ~0.2 ms of prose, ~3 ms of unique words).
FAST_MAX_CHARS = 16_384


def fastokens_encoder(tokenizer_json: str, long: PlainEncoder | None = None) -> PlainEncoder:
    """``fastokens`` over the same tokenizer.json (ImportError when it is not installed);
    segments over FAST_MAX_CHARS go to ``long`` when given."""
    import fastokens

    fast = fastokens.Tokenizer.from_json_str(tokenizer_json)
    flat: Any = getattr(fast, "encode_batch_flat", None)

    def encode_each(segments: list[str]) -> list[Sequence[int]]:
        return [fast.encode(s, add_special_tokens=False).ids for s in segments]

    def encode_flat(segments: list[str]) -> list[Sequence[int]]:
        # One buffer of little-endian uint32 for the batch: no Python int per token (a
        # list of 1,500 ids cost as much to build and pack as the BPE itself).
        ids, offsets = flat(segments, add_special_tokens=False)
        out, at = array("I"), array("Q")
        out.frombytes(ids)
        at.frombytes(offsets)
        if len(at) == 2 and at[0] == 0 and at[1] == len(out):  # one segment: all of it
            return [out]
        return [out[at[i] : at[i + 1]] for i in range(len(segments))]

    native = array("I").itemsize == 4 and array("Q").itemsize == 8 and sys.byteorder == "little"
    short = encode_flat if flat is not None and native else encode_each

    def encode(segments: list[str]) -> list[Sequence[int]]:
        if long is not None and any(len(s) > FAST_MAX_CHARS for s in segments):
            return [long([s])[0] if len(s) > FAST_MAX_CHARS else short([s])[0] for s in segments]
        return short(segments)

    return encode


def agrees(candidate: PlainEncoder, reference: PlainEncoder, corpus: list[str]) -> bool:
    """Whether ``candidate`` gives the reference's ids on every text of ``corpus``."""
    try:
        got = candidate(corpus)
    except Exception:
        return False
    return [list(x) for x in got] == [list(x) for x in reference(corpus)]


def plain_encoder(backend: Any) -> tuple[PlainEncoder, str]:
    """The encoder the segment path uses for ``backend`` (a ``tokenizers.Tokenizer``), and
    its name: ``fastokens`` when installed, enabled and exactly equal on the self-check
    corpus, else the reference."""
    reference = reference_encoder(backend)
    if os.environ.get(ENV, "1").strip() == "0":
        return reference, REFERENCE
    try:
        fast = fastokens_encoder(backend.to_str(), long=reference)
    except (ImportError, AttributeError):  # not installed; not a tokenizers.Tokenizer
        return reference, REFERENCE
    except Exception as e:  # a tokenizer.json it cannot read
        log.warning("fastokens cannot load this tokenizer (%s); using %s", e, REFERENCE)
        return reference, REFERENCE
    if not agrees(fast, reference, self_check_corpus()):
        log.warning("fastokens disagrees with %s on the self-check; using %s", REFERENCE, REFERENCE)
        return reference, REFERENCE
    return fast, FAST
