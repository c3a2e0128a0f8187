"""Fault injection for tests: make a replica's next generation requests fail before any byte
is written, as an overloaded or crashing vLLM would answer."""

from __future__ import annotations

from typing import Any

from router.errors import APIError


class Faults:
    """``fail_next(n, status)`` arms ``n`` failures; ``check()`` raises the next one (counted
    in ``stats["injected_failures"]``)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        self._remaining = 0
        self._status = 503

    def fail_next(self, n: int, status: int = 503) -> None:
        self._remaining = max(0, int(n))
        self._status = int(status)

    def check(self) -> None:
        if self._remaining > 0:
            self._remaining -= 1
            self._stats["injected_failures"] += 1
            raise APIError(self._status, f"Simulated failure (fail_next), status {self._status}")
