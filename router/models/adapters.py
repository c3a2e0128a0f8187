"""Runtime LoRA loads (vLLM's ``POST /v1/load_lora_adapter``): one in flight per (replica,
adapter), and a replica's refusal remembered for a while.

vLLM 0.34 answers the load (``vllm/entrypoints/openai/models/serving.py``,
``OpenAIServingModels.load_lora_adapter`` and ``_check_load_lora_adapter_request``): 200 on
success; 400 ``InvalidUserInput`` when the name or path is missing or the adapter is already
loaded; 404 ``NotFoundError`` when nothing is found at the path (``LoRAAdapterNotFoundError``);
500 when the engine fails to add it. Without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` the route is
not mounted at all (``vllm/entrypoints/serve/lora/api_router.py``, ``attach_router``): a 404.
A 4xx is the replica declining this adapter, not the replica failing: it is remembered per
(replica, adapter) for ``ttl_s`` so neither the replica's health nor its load calls pay for
every request naming it. A 5xx or a transport failure is the replica's (the caller counts it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How one load call ended."""

    ok: bool
    status: int = 0  # the replica's HTTP status (0: no answer)
    detail: str = ""  # its body or the transport error, for the log

    @property
    def refused(self) -> bool:
        """The replica answered and declined (a 4xx): not its failure."""
        return not self.ok and 400 <= self.status < 500


class AdapterLoads:
    """Single-flight loads and the refusals remembered, per (replica URL, adapter name)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._inflight: dict[tuple[str, str], asyncio.Future[LoadResult]] = {}
        self._refused: dict[tuple[str, str], tuple[float, int]] = {}  # -> (until, status)

    def refused(self, replica: str, adapter: str) -> int | None:
        """The status ``replica`` refused ``adapter`` with, while that is remembered."""
        hit = self._refused.get((replica, adapter))
        if hit is None:
            return None
        if hit[0] <= self.clock():
            del self._refused[(replica, adapter)]
            return None
        return hit[1]

    async def load(
        self, replica: str, adapter: str, call: Callable[[], Awaitable[LoadResult]]
    ) -> tuple[LoadResult, bool]:
        """``call``'s result, and whether this caller made the call: concurrent callers for
        the same (replica, adapter) wait for the one call in flight. A caller that leaves
        does not cancel the call the others wait for."""
        key = (replica, adapter)
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending), False
        future: asyncio.Future[LoadResult] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        task = asyncio.ensure_future(self._run(key, future, call))
        return await asyncio.shield(task), True

    async def _run(
        self,
        key: tuple[str, str],
        future: asyncio.Future[LoadResult],
        call: Callable[[], Awaitable[LoadResult]],
    ) -> LoadResult:
        try:
            result = await call()
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: no warning when no follower waited
            raise
        finally:
            del self._inflight[key]
        if result.refused:
            now = self.clock()
            for k in [k for k, (until, _) in self._refused.items() if until <= now]:
                del self._refused[k]  # bounded: configured adapters x replicas
            self._refused[key] = (now + self.ttl_s, result.status)
        future.set_result(result)
        return result
