"""What Python 3.10 lacks and the gateway uses (pyproject admits 3.10; CI runs it).

``timeout(delay)`` is ``asyncio.timeout`` on 3.11+; on 3.10, the ``async-timeout`` backport
behind the same interface (``reschedule``, ``when``, ``expired``). On 3.10 asyncio's timeouts
raise ``asyncio.TimeoutError``, which is not the builtin ``TimeoutError`` there: catch
``asyncio.TimeoutError`` (the same class on 3.11+) around ``timeout``, ``asyncio.wait_for``
and aiohttp calls.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised by CI's 3.10 run
    from types import TracebackType

    import async_timeout

    class Timeout:
        """``asyncio.Timeout``'s interface over the backport's (``update``, ``deadline``)."""

        __slots__ = ("_inner",)

        def __init__(self, delay: float | None) -> None:
            self._inner = async_timeout.timeout(delay)

        async def __aenter__(self) -> Timeout:
            await self._inner.__aenter__()
            return self

        async def __aexit__(
            self,
            exc_type: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> bool | None:
            return await self._inner.__aexit__(exc_type, exc, tb)

        def when(self) -> float | None:
            return self._inner.deadline

        def reschedule(self, when: float | None) -> None:
            if when is None:
                self._inner.reject()
            else:
                self._inner.update(when)

        def expired(self) -> bool:
            return bool(self._inner.expired)

    def timeout(delay: float | None) -> Timeout:
        return Timeout(delay)


__all__ = ["timeout"]
