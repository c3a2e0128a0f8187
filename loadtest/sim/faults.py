"""Fault injection for tests: make a replica's next generation requests fail before any byte
is written, as an overloaded or crashing vLLM would answer."""

from __future__ import annotations

import asyncio
from typing import Any

from router.core.errors import APIError


class Faults:
    """``fail_next(n, status)`` arms ``n`` failures; ``check()`` raises the next one (counted
    in ``stats["injected_failures"]``). ``hang_next(n)`` arms ``n`` requests that are
    accepted and not answered until ``release()`` (or never); ``hang()`` holds the next one
    (``hanging`` counts them)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        self._remaining = 0
        self._status = 503
        self._hang_remaining = 0
        self.hanging = 0
        self._released: asyncio.Event | None = None  # set by ``release``

    def hang_next(self, n: int) -> None:
        self._hang_remaining = max(0, int(n))

    async def hang(self) -> None:
        if self._hang_remaining > 0:
            self._hang_remaining -= 1
            self.hanging += 1
            if self._released is None:
                self._released = asyncio.Event()
            try:
                await self._released.wait()  # or cancelled when the connection goes away
            finally:
                self.hanging -= 1

    def release(self) -> None:
        """The held requests go on, as if the replica had only been slow."""
        if self._released is not None:
            self._released.set()
            self._released = None

    def fail_next(self, n: int, status: int = 503) -> None:
        self._remaining = max(0, int(n))
        self._status = int(status)

    def check(self) -> None:
        if self._remaining > 0:
            self._remaining -= 1
            self._stats["injected_failures"] += 1
            raise APIError(self._status, f"Simulated failure (fail_next), status {self._status}")
