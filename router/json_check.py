"""Checking a costly JSON body in another process before this one parses it.

``json.loads`` holds the GIL for the whole parse, in a worker thread too: a 31 MiB body of
small values (31 KB gzipped) took 2-3.6 s to parse and 0.4-1.3 s to free on a 2-core host,
and the event loop answered nothing meanwhile. A body that may be costly to parse (megabytes,
or more values than ``INLINE_VALUES`` by a count of its separators: router/json_pieces.py) is
first parsed whole and held to the body limits (router/limits.py) in a child process; one
outside them is refused from there and never parsed here, and one within them is parsed here
in pieces.
The bytes waiting for or in the check count against each client's share
(router/budget.py), so one client's bombs cannot queue ahead of everyone's large bodies
without bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from router.budget import SharedBudget
from router.errors import APIError
from router.json_pieces import may_be_costly
from router.limits import BodyLimits, check_body
from router.parse import parse_json_object

_Refusal = tuple[int, str, "str | None", "str | None"]


def check(raw: bytes, limits: BodyLimits) -> _Refusal | None:
    """In the child: None if ``raw`` is a JSON object within ``limits``, else the refusal's
    (status, message, param, code)."""
    try:
        check_body(parse_json_object(raw, whole=True), limits)
    except APIError as e:
        return e.status, e.message, e.param, e.code
    return None


class JsonCheck:
    """The child process (started at the first costly body) and the per-client bound on
    the bytes waiting for it."""

    def __init__(
        self, limits: BodyLimits, budget: SharedBudget, on_check: Callable[[str], None]
    ) -> None:
        self.limits = limits
        self.budget = budget
        # "passed", "refused", "busy" (the client's share was full) or "broken" (the child died)
        self._on_check = on_check
        self._pool: ProcessPoolExecutor | None = None

    async def check(self, raw: bytes, client: str) -> None:
        """Raise the body's refusal (a 400 naming the field, as parsing here would) if it
        may be costly and is outside the limits; a 503 when ``client`` already has its share
        of bytes waiting for the check."""
        if not may_be_costly(raw):
            return
        if self.budget.take(client, len(raw)) is not None:
            self._on_check("busy")
            raise APIError(
                503,
                "too many large request bodies from this client are being checked at once; "
                "retry shortly",
                code="overloaded",
            )
        try:
            refusal = await self._run(raw)
        finally:
            self.budget.give_back(client, len(raw))
        self._on_check("passed" if refusal is None else "refused")
        if refusal is not None:
            status, message, param, code = refusal
            raise APIError(status, message, param=param, code=code)

    async def _run(self, raw: bytes) -> _Refusal | None:
        """``check`` in the child; a child that died (killed, out of memory) is replaced
        once, and a second death is a 503, never a pool that fails every later body."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            try:
                return await loop.run_in_executor(self._executor(), check, raw, self.limits)
            except BrokenProcessPool:
                self.close()
                self._on_check("broken")
        raise APIError(
            503, "the request body could not be checked; retry shortly", code="overloaded"
        )

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork of this threaded, event-loop-running process is not safe.
            ctx = multiprocessing.get_context("spawn")
            # Niced: on a small host its seconds of parsing yield the CPU to the event loop.
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=os.nice, initargs=(10,)
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
