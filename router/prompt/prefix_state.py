"""The prefix-state cache: a request that extends a conversation already seen tokenizes (and
the gateway hashes) only what follows it.

A chat request is found by its structure, not its text: the key of its first ``k`` messages
chains the hash of each normalised message onto a context key (the cache-salt scope, the
tools, the template kwargs and flags). Under a key the cache keeps a *prefix state*: the
rendered prompt up to the end of an added token (``<|im_start|>``...), its token ids, and,
filled in by the gateway, the chained hashes of its full blocks per (salt and adapter root,
block size). A request whose key of some ``k`` leading messages is held uses the state only if
its own rendered prompt starts with the state's text: then, because the segment tokenizer cuts
at added tokens anyway (router/prompt/segments.py) and no added token holds another one, the
ids of the prompt are the state's ids followed by those of the rest. A template that renders
an earlier turn differently once a later one follows (Qwen3 drops the reasoning of turns
before the last user query) fails that check and takes the full path: it is detected, not
guessed (``rejected`` counts it).

Each request stores, for the next ones, the state of its whole prompt up to its last added
token (key: all its messages; the next turn of the conversation extends it) and of its prompt
up to the last message (key: all but the last; another question after the same system
prompt and history extends it). Bounded by cached tokens, least recently used first.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

DEFAULT_PREFIX_STATE_TOKENS = 2_000_000
_MAX_ROOTS = 8  # hash chains kept per state: one per (salt + adapter root, block size)


# A state's ids are sliced out of its prompt's on first use when the prompt has at most this
# many ids more (the whole prompt's state: the generation prompt after its last added token);
# else at once, so a state never keeps much more than its own ids alive.
_LAZY_IDS_SLACK = 64


class PrefixState:
    """A rendered prompt prefix that ends with an added token, and its ids and hashes.

    The text is the first ``chars`` characters of a prompt the state was cut from, and the
    ids the first ``tokens`` of its ids, both sliced on first use: a state most requests
    never extend (a conversation's latest turn) then costs no copy of its prompt. (The
    prompt's ids may grow after it, never change: only what follows ``tokens`` would.)"""

    __slots__ = ("_ids", "_text", "chars", "hashes", "source", "source_ids", "tokens")

    def __init__(self, source: str, chars: int, ids: array[int], tokens: int) -> None:
        self.source: str | None = source  # the prompt, until the text is sliced out of it
        self.chars = chars
        self._text: str | None = None
        self.tokens = tokens
        lazy = len(ids) - tokens <= _LAZY_IDS_SLACK
        # the prompt's ids, until this state's are sliced out of them
        self.source_ids: array[int] | None = ids if lazy else None
        self._ids: array[int] | None = None if lazy else ids[:tokens]
        # (root hash, block size) -> hashes of the full blocks of ``ids``
        self.hashes: dict[tuple[int, int], tuple[int, ...]] = {}

    @property
    def ids(self) -> array[int]:
        ids = self._ids
        if ids is None:
            source = self.source_ids
            assert source is not None
            ids = self._ids = source[: self.tokens]
            self.source_ids = None
        return ids

    @property
    def text(self) -> str:
        text = self._text
        if text is None:
            source = self.source
            assert source is not None
            text = source if len(source) == self.chars else source[: self.chars]
            self._text, self.source = text, None
        return text

    def is_prefix_of(self, text: str) -> bool:
        return len(text) >= self.chars and text.startswith(self.text)

    def known_hashes(self, root: int, block_size: int) -> tuple[int, ...] | None:
        return self.hashes.get((root, block_size))

    def keep_hashes(self, root: int, block_size: int, hashes: Sequence[int]) -> None:
        """Remember the first ``len(ids) // block_size`` of a prompt's block hashes (those
        the prompt shares with this state), if ``hashes`` has them all."""
        n = self.tokens // block_size
        if n and len(hashes) >= n and len(self.hashes) < _MAX_ROOTS:
            self.hashes.setdefault((root, block_size), tuple(hashes[:n]))


class PromptIds(array):  # type: ignore[type-arg,unused-ignore]
    """A prompt's token ids (``array('I')``) that know which prefix state they start with
    (``prefix``: its hashes can be reused) and which states they created (``stored``: their
    hashes are to be filled from this prompt's)."""

    prefix: PrefixState | None
    stored: tuple[PrefixState, ...]


# Keys only find candidates (the text check decides), so ``repr`` (insertion-ordered) serves
# where a message has more than a role and a text: equal messages built alike give the same
# key in this process. A role and a text are hashed as they are: ``repr`` of a 20 KB text
# costs ~0.3M instructions (it escapes every character). A long text is keyed by its length
# and its two ends (a copy of a 20 KB system prompt's UTF-8 bytes to hash it whole cost ~25k
# instructions a request): texts of one length that differ only inside (a date, a name in
# a templated system prompt) share a key, and a key holds up to ``_BUCKET`` states, so they
# do not evict each other (tests/prompt/test_prefix_state.py).
_WHOLE_CHARS = 1024  # a text up to this long is hashed whole
_END_CHARS = 256  # else its first and last this many characters, and its length


def _text_key(text: str, seed: int) -> int:
    digest = xxhash.xxh3_64_intdigest
    n = len(text)
    if n <= _WHOLE_CHARS:
        return digest(text.encode("utf-8", "surrogatepass"), seed)
    ends = text[:_END_CHARS] + text[n - _END_CHARS :]
    return digest(ends.encode("utf-8", "surrogatepass"), seed ^ n)


def _message_key(m: Mapping[str, Any], seed: int) -> int:
    content, role = m.get("content"), m.get("role")
    digest = xxhash.xxh3_64_intdigest
    if len(m) == 2 and isinstance(content, str) and isinstance(role, str):
        return _text_key(content, digest(role.encode("utf-8", "surrogatepass"), seed))
    return digest(repr(m).encode("utf-8", "surrogatepass"), seed)


# (scope, flags, template kwargs' items) -> context key, for contexts without tools or
# documents (the common case: ``repr`` of the context was ~10k instructions a request).
# Keys only find candidates: values equal but of different types (1, True) may share one.
_CONTEXTS: dict[tuple[Any, ...], int] = {}


def context_key(norm: Mapping[str, Any], scope: int) -> int:
    """What the rendered text depends on besides the messages, hashed with the cache-salt
    scope: states are never shared across scopes (nor across renderers: one cache each)."""
    if norm["tools"] is None and norm["documents"] is None:
        memo = (
            scope,
            norm["add_generation_prompt"],
            norm["continue_final_message"],
            norm["add_special_tokens"],
            *norm["template_kwargs"].items(),
        )
        try:
            found = _CONTEXTS.get(memo)
        except TypeError:  # a value that cannot be hashed (a list): computed
            return _context_key(norm, scope)
        if found is None:
            if len(_CONTEXTS) >= 256:
                _CONTEXTS.clear()
            found = _CONTEXTS[memo] = _context_key(norm, scope)
        return found
    return _context_key(norm, scope)


def _context_key(norm: Mapping[str, Any], scope: int) -> int:
    ctx = [
        norm["tools"],
        norm["template_kwargs"],
        norm["documents"],
        norm["add_generation_prompt"],
        norm["continue_final_message"],
        norm["add_special_tokens"],
    ]
    return xxhash.xxh3_64_intdigest(repr(ctx).encode("utf-8", "surrogatepass"), scope)


def message_keys(norm: Mapping[str, Any], scope: int) -> list[int]:
    """``keys[k]``: the key of the first ``k`` messages (``keys[0]``: the context alone)."""
    key = context_key(norm, scope)
    keys = [key]
    for m in norm["conversation"]:
        key = _message_key(m, key)
        keys.append(key)
    return keys


_BUCKET = 4  # states kept under one key (prompts whose messages share keys)


class PrefixStates:
    """The LRU of prefix states of one renderer (thread-safe), bounded by cached tokens.
    Each key holds a few states (a tuple, the most recent last), used most recent first."""

    def __init__(self, max_tokens: int = DEFAULT_PREFIX_STATE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._states: OrderedDict[int, tuple[PrefixState, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.rejected = 0  # a state whose text the prompt does not start with (see module)

    def find(self, keys: Sequence[int], text: str) -> PrefixState | None:
        """The state of the most leading messages that ``text`` starts with."""
        states = self._states
        for k in range(len(keys) - 1, 0, -1):
            bucket = states.get(keys[k])
            if bucket is None:
                continue
            for i in range(len(bucket) - 1, -1, -1):
                state = bucket[i]
                if state.is_prefix_of(text):
                    with self._lock:
                        if keys[k] in states:
                            states.move_to_end(keys[k])
                    self.hits += 1
                    return state
                self.rejected += 1
        self.misses += 1
        return None

    def store(
        self, key: int, text: str, chars: int, ids: array[int], tokens: int
    ) -> PrefixState | None:
        """Keep ``ids[:tokens]`` as the state of ``text[:chars]`` under ``key`` (unless one
        with the same text is there: nothing is copied then); returns the new state, or
        None. A key's oldest state goes when it holds ``_BUCKET``."""
        if tokens == 0 or tokens > self.max_tokens // 4:
            return None
        with self._lock:
            for old in self._states.get(key, ()):
                if old.chars == chars and text.startswith(old.text):
                    self._states.move_to_end(key)
                    return None
        state = PrefixState(text, chars, ids, tokens)
        with self._lock:
            bucket = self._states.get(key, ())
            if len(bucket) >= _BUCKET:
                self.tokens -= bucket[0].tokens
                bucket = bucket[1:]
            self._states[key] = (*bucket, state)
            self._states.move_to_end(key)
            self.tokens += tokens
            while self.tokens > self.max_tokens and self._states:
                _, evicted = self._states.popitem(last=False)
                self.tokens -= sum(s.tokens for s in evicted)
        return state

    def info(self) -> dict[str, int]:
        return {
            "entries": sum(len(b) for b in self._states.values()),
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "hits": self.hits,
            "misses": self.misses,
            "rejected": self.rejected,
        }

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self.tokens = 0
