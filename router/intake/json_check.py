"""Checking a costly JSON body in another process before this one parses it.

``json.loads`` holds the GIL for the whole parse, in a worker thread too: a 31 MiB body of
small values (31 KB gzipped) took 2-3.6 s to parse and 0.4-1.3 s to free on a 2-core host,
and the event loop answered nothing meanwhile. A body that may be costly to parse (megabytes,
or more values than ``INLINE_VALUES`` by a count of its separators: router/intake/json_pieces.py) is
first parsed whole and held to the body limits (router/intake/shapes.py) in a child process; one
outside them is refused from there and never parsed here, and one within them is parsed here
in pieces.
The bytes waiting for or in the check count against each client's share
(router/intake/budget.py), so one client's bombs cannot queue ahead of everyone's large bodies
without bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from router.core.errors import APIError
from router.intake.body import decode, decode_body
from router.intake.budget import SharedBudget
from router.intake.json_pieces import INLINE_BYTES, may_be_costly
from router.intake.parse import parse_json_object
from router.intake.shapes import BodyLimits, check_body

_Refusal = tuple[int, str, "str | None", "str | None"]
INFLATE_INLINE = 256 * 1024  # bodies inflating past this are inflated in a worker thread
SPOOL_BYTES = 1024 * 1024  # larger bodies reach the child through a file, not the pipe
_SPOOL_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def check(data: bytes | str, coding: str, max_bytes: int, limits: BodyLimits) -> _Refusal | None:
    """In the child: None if the body is a JSON object within ``limits``, else the refusal's
    (status, message, param, code). ``data``: the body as received (a path: spooled to a
    file), decoded here from ``coding`` up to ``max_bytes``."""
    try:
        if isinstance(data, str):
            with open(data, "rb") as f:
                data = f.read()
        raw = decode(coding, data, max_bytes) if coding else data
        check_body(parse_json_object(raw, whole=True), limits)
    except APIError as e:
        return e.status, e.message, e.param, e.code
    return None


def _spool(data: bytes) -> str:
    """``data`` in a file for the child (tmpfs where there is one). ``os.write`` copies with
    the GIL released, where pickling it for the pipe was a memcpy holding it (10-20 ms for
    31 MiB on a loaded host)."""
    fd, path = tempfile.mkstemp(prefix="prefix-router-body-", dir=_SPOOL_DIR)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


async def _inflate(coding: str, raw: bytes, limit: int) -> bytes:
    """``raw`` inflated within ``limit``: in place up to ``INFLATE_INLINE`` bytes of output,
    in a worker thread past that (zlib releases the GIL), whatever its compressed size: a
    24 KB gzip body inflating to 2 MiB held the loop 2-4 ms in place, and a tenant's flood
    of them added up."""
    if limit <= INFLATE_INLINE:
        return await decode_body(coding, raw, limit)
    try:
        return await decode_body(coding, raw, INFLATE_INLINE)
    except APIError as e:
        if e.status != 413:
            raise
    return await asyncio.to_thread(decode, coding, raw, limit)


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

    async def body(self, raw: bytes, coding: str, client: str, max_bytes: int) -> bytes:
        """The body ``raw`` (as received, in ``coding``) decoded within ``max_bytes``, once
        a body that may be costly to parse was checked: its refusal raised (a 400 naming
        the field, as parsing here would; 413 past ``max_bytes`` decoded) if it is outside
        the limits; a 503 when ``client`` already has its share of bytes waiting for the
        check. A compressed body that inflates past ``INLINE_BYTES`` is inflated by the
        child, not here: a bomb is refused from there having cost this process 2 MiB."""
        if not coding:
            if may_be_costly(raw):
                await self._check(raw, "", client, max_bytes, len(raw))
            return raw
        head = min(max_bytes, INLINE_BYTES)
        try:
            body = await _inflate(coding, raw, head)
        except APIError as e:
            if e.status != 413 or head == max_bytes:
                raise
            # More than INLINE_BYTES once inflated: the child inflates and checks it, charged
            # as the most it may inflate to, then it is inflated here only if it passed.
            await self._check(raw, coding, client, max_bytes, max_bytes)
            # Off the loop whatever its compressed size: it inflates past INLINE_BYTES (24 KB
            # of gzip inflating to 24 MB held the loop ~40 ms when decoded in place).
            return await asyncio.to_thread(decode, coding, raw, max_bytes)
        if may_be_costly(body):
            await self._check(body, "", client, max_bytes, len(body))
        return body

    async def _check(
        self, data: bytes, coding: str, client: str, max_bytes: int, charge: int
    ) -> None:
        if self.budget.take(client, charge) is not None:
            self._on_check("busy")
            raise APIError(
                503,
                "too many large request bodies from this client are being checked at once; "
                "retry shortly",
                code="overloaded",
            )
        path = None
        try:
            if len(data) > SPOOL_BYTES:
                path = await asyncio.to_thread(_spool, data)
            refusal = await self._run(path or data, coding, max_bytes)
        finally:
            self.budget.give_back(client, charge)
            if path is not None:
                os.unlink(path)
        self._on_check("passed" if refusal is None else "refused")
        if refusal is not None:
            status, message, param, code = refusal
            raise APIError(status, message, param=param, code=code)

    async def _run(self, data: bytes | str, coding: str, max_bytes: int) -> _Refusal | None:
        """``check`` in the child; a child that died (killed, out of memory) is replaced
        once, and a second death is a 503, never a pool that fails every later body."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            try:
                return await loop.run_in_executor(
                    self._executor(), check, data, coding, max_bytes, self.limits
                )
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
