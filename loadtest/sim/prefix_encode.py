"""The simulator's encoding of a growing conversation: the ids of its longest prefix encoded
before, then the rest's.

vLLM encodes every prompt whole, and so did the simulator: 0.25-0.3 s of CPU for a
100k-token agent context (Qwen3's tokenizer, 680 KB of text), so a 2-core host could not
simulate more than a few long sessions. An agent's next turn repeats its whole previous
prompt, so the simulator keeps the ids of each prompt up to its last added token
(``<|im_start|>`` before the generation prompt, in Qwen's template) and encodes only what
follows. That is exact where the tokenizer splits added tokens out of the text before any
normalising, pre-tokenizing or BPE, so that the ids of the two sides of a cut right after
one concatenate to the ids of the whole: ``PrefixEncoder`` checks that on probe texts when
it is built (an added token with ``lstrip``/``rstrip``, or a pre-tokenizer that treats the
start of a text specially, as SentencePiece's ``prepend_scheme: first`` does, fails it) and
otherwise encodes every prompt whole. It shares nothing with the gateway's renderer (the
simulator stands for vLLM, which the gateway's predictions are checked against).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

import xxhash

MIN_CHARS = 4096  # shorter prompts are encoded whole: nothing to save


class PrefixEncoder:
    """``encode(text)``: ``tokenizer.encode(text, add_special_tokens=False)``, from a cached
    prefix where that is exact. Bounded LRU of ``max_tokens`` ids."""

    def __init__(self, tokenizer: Any, max_tokens: int = 4_000_000) -> None:
        self._tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._cache: OrderedDict[int, array[int]] = OrderedDict()
        self._tokens = 0
        self.hits = 0  # prompts encoded from a cached prefix
        self._lock = threading.Lock()  # prompts are tokenized in worker threads
        added = [t for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content]
        contents = sorted({t.content for t in added}, key=len, reverse=True)
        self._cuts = re.compile("|".join(map(re.escape, contents))) if contents else None
        verbatim = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        self.exact = self._cuts is not None and verbatim and self._probe(contents)

    def _whole(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _probe(self, added: list[str]) -> bool:
        """Whether cutting right after an added token leaves the ids unchanged, on texts that
        would show a start-of-text rule (every added token is matched verbatim already)."""
        for token in added[:8]:
            for before, after in (
                ("Hello world", " and then"),
                ("a\n", "\nb c"),
                ("x", "y z"),
                (" lead", "  two spaces\tand a tab"),
                ("café", "naïve über"),
            ):
                whole = self._whole(before + token + after)
                if whole != self._whole(before + token) + self._whole(after):
                    return False
        return True

    def encode(self, text: str) -> list[int]:
        if not self.exact or len(text) < MIN_CHARS:
            return self._whole(text)
        assert self._cuts is not None
        ends = [m.end() for m in self._cuts.finditer(text)]
        if not ends:
            return self._whole(text)
        # One pass of a streaming hash: the key of every prefix that ends at a cut.
        h = xxhash.xxh3_128()
        keys, pos = [], 0
        for end in ends:
            h.update(text[pos:end].encode("utf-8", "surrogatepass"))
            keys.append(h.intdigest())
            pos = end
        ids: array[int] = array("I")
        start = 0
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                hit = self._cache.get(keys[i])
                if hit is not None:
                    self._cache.move_to_end(keys[i])
                    ids.extend(hit)
                    start = ends[i]
                    self.hits += 1
                    break
        last = ends[-1]
        if last > start:  # up to the last added token: what the next turn repeats
            ids.extend(self._whole(text[start:last]))
            self._put(keys[-1], array("I", ids))
        ids.extend(self._whole(text[last:]))
        return ids.tolist()

    def _put(self, key: int, ids: array[int]) -> None:
        if len(ids) > self.max_tokens // 4:
            return
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._cache[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, evicted = self._cache.popitem(last=False)
                self._tokens -= len(evicted)
