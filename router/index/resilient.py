"""Shared (Redis) prefix state with a local fallback: Redis trouble costs hit rate, never
requests.

``ResilientIndex`` writes every update to both a primary index (``RedisIndex``) and a local
``MemoryIndex``, and answers ``match`` from the primary under a tight timeout. It is a circuit
breaker:

* closed (``redis_up``): ``match`` asks the primary; if the answer is not back within
  ``match_timeout_s`` the local index answers instead. The slow primary call is *not*
  cancelled (redis-py drops the connection of a cancelled command, and reconnecting on a
  loaded box is slower than letting the reply land); its late result is discarded and its
  duration stays bounded by the client's socket timeout. An outage error (connection refused
  or reset, socket timeout) opens the circuit at once; timeouts and other errors (a script
  error, this process's connection pool exhausted) open it when, over the last
  ``failure_window_s``, at least ``min_timeouts`` matches failed, they were at least
  ``timeout_ratio`` of the matches asked, and the failures span at least ``min_outage_s``.
  (Not "N in a row": under concurrency one short stall -- a GC pause, a CPU-starved moment,
  a burst after idle -- times out every match in flight at the same instant, and that is no
  reason to drop shared state for a second; a hung or persistently slow Redis keeps failing
  over time and trips it within ~``min_outage_s``.)
* open (not ``redis_up``): the primary is skipped entirely, reads and writes, so an outage
  adds no latency at all; a background probe pings it every ``probe_interval_s`` and closes
  the circuit by itself once it answers. Replica drops and capacity changes that could not
  reach Redis while it was down are replayed first.

State changes are logged once each way and reported to ``on_state_change`` callbacks; the
counters (``fallbacks``, ``match_timeouts``, ``errors``, ``write_failures``,
``skipped_writes``) are plain attributes for metrics. A Redis restart that loses the data
only costs hit rate: the index refills from records, and ``RedisIndex`` re-stores capacities
it knows on its next record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.core.redis_client import error_text
from router.core.tasks import cancel_and_wait
from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex

log = logging.getLogger(__name__)

# A match round trip is ~0.2-0.3 ms idle (loadtest/bench_redis_index.py), but on a loaded
# 2-core box the gateway's event loop and redis-server share the CPUs: with 16 lookups in
# flight the p99 measured 4-9 ms. 10 ms keeps fallbacks rare there (3-5 in 6,000; 5 ms gave
# 28) and is still small next to a prefill.
DEFAULT_MATCH_TIMEOUT_S = 0.010
DEFAULT_WRITE_TIMEOUT_S = 0.5
DEFAULT_PROBE_INTERVAL_S = 1.0
DEFAULT_FAILURE_WINDOW_S = 1.0
DEFAULT_MIN_TIMEOUTS = 5
DEFAULT_TIMEOUT_RATIO = 0.5
DEFAULT_MIN_OUTAGE_S = 0.1

T = TypeVar("T")


def is_outage(exc: BaseException) -> bool:
    """Errors that mean Redis is unreachable (open the circuit at once), as opposed to errors
    of one call or of local overload (counted in the failure window like timeouts)."""
    if isinstance(exc, MaxConnectionsError):  # our own pool is exhausted: local overload
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError))


StateCallback = Callable[[bool], Any]


class ResilientIndex:
    """``PrefixIndex``: ``primary`` (shared, may fail) with ``local`` as the fallback."""

    def __init__(
        self,
        primary: PrefixIndex,
        local: MemoryIndex | None = None,
        *,
        match_timeout_s: float = DEFAULT_MATCH_TIMEOUT_S,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        probe_timeout_s: float | None = None,
        failure_window_s: float = DEFAULT_FAILURE_WINDOW_S,
        min_timeouts: int = DEFAULT_MIN_TIMEOUTS,
        timeout_ratio: float = DEFAULT_TIMEOUT_RATIO,
        min_outage_s: float = DEFAULT_MIN_OUTAGE_S,
        name: str = "redis",
    ) -> None:
        self.primary = primary
        self.local = local if local is not None else MemoryIndex()
        self.match_timeout_s = match_timeout_s
        self.write_timeout_s = write_timeout_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = (
            probe_timeout_s if probe_timeout_s is not None else min(0.5, probe_interval_s)
        )
        self.failure_window_s = failure_window_s
        self.min_timeouts = max(1, min_timeouts)
        self.timeout_ratio = timeout_ratio
        self.min_outage_s = min_outage_s
        self.name = name

        self.redis_up = True
        self.fallbacks = 0  # matches answered by the local index
        self.match_timeouts = 0  # primary matches that missed match_timeout_s
        self.errors = 0  # primary calls that raised (reads, writes, probes excluded)
        self.write_failures = 0  # primary writes that raised or timed out (swallowed)
        self.skipped_writes = 0  # primary writes not attempted because the circuit was open
        self.transitions = 0  # up->down and down->up changes
        self.down_since: float | None = None  # time.monotonic() of the last up->down

        # times of the primary matches, and of those that failed, in the last failure_window_s
        self._calls: deque[float] = deque()
        self._fails: deque[float] = deque()
        self._callbacks: list[StateCallback] = []
        self._state_changed = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None
        self._late: set[asyncio.Future[Any]] = set()
        # Membership/capacity changes that could not reach the primary: replayed (drops
        # first) by the recovery probe before the circuit closes.
        self._pending_drops: set[str] = set()
        self._pending_capacity: dict[str, int] = {}
        self._closed = False
        # A primary that queues its writes (``RedisMapIndex``): its flushes run here, under
        # the breaker; a write while the circuit is open is skipped, not queued.
        self._buffered = bool(getattr(primary, "buffered", False))
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        """Optional: check the primary once (within ``probe_timeout_s``) so that a gateway
        started while Redis is down says so at once and routes locally from the first
        request. Returns ``redis_up``; never raises."""
        try:
            await asyncio.wait_for(self._probe_once(), self.probe_timeout_s)
        except Exception as exc:
            self._trip(f"not reachable at startup: {error_text(exc)}")
        return self.redis_up

    # state -------------------------------------------------------------------------------

    def on_state_change(self, callback: StateCallback) -> None:
        """Call ``callback(redis_up)`` on every transition (from the event loop thread)."""
        self._callbacks.append(callback)

    async def wait_state(self, up: bool) -> None:
        """Return once ``redis_up == up`` (immediately if it already is)."""
        while self.redis_up != up:
            self._state_changed.clear()
            await self._state_changed.wait()

    def _set_state(self, up: bool, reason: str = "") -> None:
        if up == self.redis_up:
            return
        self.redis_up = up
        self.transitions += 1
        if up:
            down_for = time.monotonic() - (self.down_since or time.monotonic())
            self.down_since = None
            log.info(
                "%s index reachable again after %.1fs; using shared prefix state",
                self.name,
                down_for,
            )
        else:
            self.down_since = time.monotonic()
            log.warning(
                "%s index unavailable (%s); answering from the local index and probing every %.1fs",
                self.name,
                reason,
                self.probe_interval_s,
            )
        self._state_changed.set()
        for cb in list(self._callbacks):
            try:
                cb(up)
            except Exception:
                log.exception("state-change callback failed")

    def _trip(self, reason: str) -> None:
        """Open the circuit (idempotent) and make sure the recovery probe runs."""
        self._calls.clear()
        self._fails.clear()
        if self._buffered:
            self.skipped_writes += self.primary.discard()  # type: ignore[attr-defined]
        self._set_state(False, reason)
        if not self._closed and (self._probe_task is None or self._probe_task.done()):
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_once(self) -> None:
        ping = getattr(self.primary, "ping", None)
        if ping is not None:
            await ping()
        else:
            await self.primary.match([0], ["__probe__"])

    async def _recover(self) -> None:
        await self._probe_once()
        for replica in list(self._pending_drops):
            await self.primary.drop_replica(replica)
            self._pending_drops.discard(replica)
        for replica, blocks in list(self._pending_capacity.items()):
            await self.primary.set_capacity(replica, blocks)
            if self._pending_capacity.get(replica) == blocks:
                del self._pending_capacity[replica]

    async def _probe_loop(self) -> None:
        while not self._closed and not self.redis_up:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await asyncio.wait_for(self._recover(), self.probe_timeout_s)
            except Exception as exc:  # still down: keep probing quietly
                log.debug("%s probe failed: %r", self.name, exc)
                continue
            self._set_state(True)

    def _note(self, failed: bool) -> bool:
        """Record one primary match outcome; True when the failures warrant opening."""
        now = time.monotonic()
        horizon = now - self.failure_window_s
        calls, fails = self._calls, self._fails
        calls.append(now)
        if failed:
            fails.append(now)
        while calls[0] < horizon:
            calls.popleft()
        while fails and fails[0] < horizon:
            fails.popleft()
        return (
            failed
            and len(fails) >= self.min_timeouts
            and len(fails) >= self.timeout_ratio * len(calls)
            and now - fails[0] >= self.min_outage_s
        )

    def _failing(self) -> str:
        return (
            f"{len(self._fails)} of {len(self._calls)} matches in {self.failure_window_s:g}s "
            f"failed or were slower than {self.match_timeout_s * 1000:g} ms"
        )

    # calls -------------------------------------------------------------------------------

    def _forget_late(self, task: asyncio.Future[Any]) -> None:
        """Done callback of a primary call that outlived its timeout."""
        self._late.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.errors += 1
            if is_outage(exc) and not self._closed:
                self._trip(f"late reply failed: {error_text(exc)}")

    async def _primary(self, make: Callable[[], Awaitable[T]], timeout: float) -> T:
        """Run a primary call with ``timeout``; raise TimeoutError (call left running) or the
        call's own exception."""
        task: asyncio.Future[T] = asyncio.ensure_future(make())
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            self._late.add(task)
            task.add_done_callback(self._forget_late)
            raise TimeoutError
        return task.result()

    async def write_primary(self, what: str, make: Callable[[], Awaitable[Any]]) -> bool:
        """A write to the primary alone, under the same breaker and timeout as the others
        (a KV event stream's new owner catching the shared index up). True if it landed
        (a buffered primary's: queued, flushed by the next flush)."""
        self._ensure_flusher()
        return await self._write(what, make)

    # flushes (a buffered primary) ----------------------------------------------------------

    def _ensure_flusher(self) -> None:
        if self._buffered and not self._closed and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        primary: Any = self.primary
        while not self._closed:
            await primary.due()
            if self.redis_up:
                await self._write("flush", primary.flush)
            else:
                self.skipped_writes += primary.discard()

    async def flush(self) -> bool:
        """Send a buffered primary's queued writes now (tests, shutdown). True if they
        landed (or there were none)."""
        if not self._buffered:
            return True
        return await self._write("flush", self.primary.flush)  # type: ignore[attr-defined]

    async def _queue(self, what: str, make: Callable[[], Awaitable[Any]]) -> bool:
        """A buffered primary's write: queued at once while the circuit is closed."""
        if not self.redis_up:
            self.skipped_writes += 1
            return False
        self._ensure_flusher()
        await make()
        return True

    async def _write(self, what: str, make: Callable[[], Awaitable[Any]]) -> bool:
        if not self.redis_up:
            self.skipped_writes += 1
            return False
        try:
            await self._primary(make, self.write_timeout_s)
            return True
        except TimeoutError:
            self.write_failures += 1
            self._trip(f"{what} timed out after {self.write_timeout_s * 1000:.0f} ms")
        except Exception as exc:
            self.write_failures += 1
            self.errors += 1
            if is_outage(exc):
                self._trip(f"{what} failed: {error_text(exc)}")
            else:
                log.debug("%s %s failed: %r", self.name, what, exc)
        return False

    # PrefixIndex --------------------------------------------------------------------------

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        if self.redis_up:
            try:
                out = await self._primary(
                    lambda: self.primary.match(block_hashes, replicas), self.match_timeout_s
                )
            except TimeoutError:
                self.match_timeouts += 1
                if self._note(failed=True):
                    self._trip(self._failing())
            except Exception as exc:
                self.errors += 1
                if is_outage(exc):
                    self._trip(f"match failed: {error_text(exc)}")
                elif self._note(failed=True):
                    self._trip(f"{self._failing()}; last: {error_text(exc)}")
            else:
                self._note(failed=False)
                return out
        self.fallbacks += 1
        return await self.local.match(block_hashes, replicas)

    async def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        await self.local.record(replica, block_hashes)
        write = self._queue if self._buffered else self._write
        await write("record", lambda: self.primary.record(replica, block_hashes))

    async def forget(self, replica: str, block_hashes: Sequence[int]) -> None:
        await self.local.forget(replica, block_hashes)
        write = self._queue if self._buffered else self._write
        await write("forget", lambda: self.primary.forget(replica, block_hashes))

    async def set_capacity(self, replica: str, blocks: int) -> None:
        await self.local.set_capacity(replica, blocks)
        write = self._queue if self._buffered else self._write
        if await write("set_capacity", lambda: self.primary.set_capacity(replica, blocks)):
            self._pending_capacity.pop(replica, None)
        else:
            self._pending_capacity[replica] = blocks

    async def drop_replica(self, replica: str) -> None:
        await self.local.drop_replica(replica)
        self._pending_capacity.pop(replica, None)
        if await self._write("drop_replica", lambda: self.primary.drop_replica(replica)):
            self._pending_drops.discard(replica)
        else:
            self._pending_drops.add(replica)

    def size(self, replica: str) -> int:
        return self.primary.size(replica) if self.redis_up else self.local.size(replica)

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._flusher)
        if self._buffered and self.redis_up:  # what this gateway learned last still lands
            await self._write("flush", self.primary.flush)  # type: ignore[attr-defined]
        await cancel_and_wait(self._probe_task, *self._late)
        await self.local.close()
        await self.primary.close()
