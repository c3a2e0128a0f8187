"""What one request's tokenizing runs under, set by its caller for the block that renders and
tokenizes it: the segment cache's scope (the cache salt), the uncached text it may encode in
place before handing over to a thread, and its CPU and context budget."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import xxhash

from router.core.errors import APIError

T = TypeVar("T")


class NeedsThread(Exception):
    """Raised inside ``Renderer.inline(...)`` when the prompt has more uncached text than the
    inline budget: the caller should tokenize it in a worker thread instead."""


# Per-thread (per-context) budget of uncached characters to BPE-encode inline; None = any.
INLINE_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "prefix_router_inline_budget", default=None
)
# Seed of the segment-cache keys in this context: the request's cache-salt scope (0 = the
# unsalted scope). A hit is fast and a miss is slow, so a cache shared across scopes would
# let one tenant time whether another recently sent a text; keys seeded by the scope keep
# the scopes as far apart as the replicas' salted prefix caches are.
CACHE_SCOPE: contextvars.ContextVar[int] = contextvars.ContextVar(
    "prefix_router_cache_scope", default=0
)


def current_scope() -> int:
    """The segment-cache seed of the scope in force (``cache_scope``)."""
    return CACHE_SCOPE.get()


def cache_scope_seed(cache_salt: str | None) -> int:
    """The segment-cache seed of requests sent with ``cache_salt`` (0 when unsalted)."""
    if not cache_salt:
        return 0
    return xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass")) or 1


@dataclass(slots=True)
class Budget:
    cpu_s: float  # thread CPU seconds for new text, from the block's start
    deadline: float  # time.thread_time() at which it is spent
    max_tokens: int | None  # a prompt longer than this is refused (the model's context)
    tokens: int = 0  # prompt tokens found so far in this block


BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
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
        Budget(cpu_s, time.thread_time() + cpu_s, max_tokens)
        if cpu_s is not None and cpu_s > 0
        else None
    )
    token = BUDGET.set(state)
    try:
        yield
    finally:
        BUDGET.reset(token)


class _Setting(Generic[T]):
    """``var`` set to ``value`` within the block. A class, not ``contextlib.contextmanager``:
    every request enters two of these, and a generator-based one costs a generator and
    three more Python calls per use."""

    __slots__ = ("_token", "_value", "_var")

    def __init__(self, var: contextvars.ContextVar[T], value: T) -> None:
        self._var = var
        self._value = value

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._token)


def inline(max_uncached_chars: int) -> contextlib.AbstractContextManager[None]:
    """Within this block, tokenizing raises ``NeedsThread`` instead of BPE-encoding more
    than ``max_uncached_chars`` of uncached text, so an event loop can tokenize a cached
    prompt in place (microseconds) and hand only real work to a thread."""
    return _Setting(INLINE_BUDGET, max_uncached_chars)


def cache_scope(cache_salt: str | None) -> contextlib.AbstractContextManager[None]:
    """Within this block, segment-cache entries are those of the ``cache_salt`` scope:
    text cached under another salt is a miss here, exactly as on a replica."""
    return _Setting(CACHE_SCOPE, cache_scope_seed(cache_salt))
