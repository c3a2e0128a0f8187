"""Background tasks: spawning them, and stopping them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tasks and return once every one has finished, whatever it raised.

    Cancels again while one still runs: on Python 3.11 ``asyncio.wait_for`` can swallow a
    cancellation that arrives just as its inner call completes, and a ``while True`` loop
    around it then runs on, so a single ``cancel(); await task`` can hang (seen as a 120 s test
    timeout in tests/test_shared_state.py)."""
    pending = {t for t in tasks if t is not None}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for task in tasks:
        if task is not None and not task.cancelled():
            task.exception()  # retrieved: a crashed loop is not reported again at exit


class Background:
    """Fire-and-forget work of one gateway (index writes, a lazy tail's record), kept so
    that stopping waits for it."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
