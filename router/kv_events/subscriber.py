"""The subscriber: one ZMQ SUB socket per replica, its liveness, and the owners that do the
work (see the package doc for the rules): ``position`` (sequence, replay, restarts),
``apply`` (events -> index writes), ``checks`` (placements), ``takeover`` (fleet mode)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.index.base import PrefixIndex
from router.kv_events.apply import Applier, IndexHandle, do
from router.kv_events.checks import Checks
from router.kv_events.ownership import StreamLeases
from router.kv_events.position import Position
from router.kv_events.precise_index import PreciseIndex
from router.kv_events.replay import Replayer
from router.kv_events.streams import Endpoints, Stream
from router.kv_events.takeover import Takeovers
from router.kv_events.wire import WireError, parse_frames

log = logging.getLogger("prefix_router.kv_events")

# A vLLM batch is one engine step's events (tens of KB; a few MB for a step evicting
# thousands of blocks): bigger messages are a hostile or broken publisher's.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
YIELD_S = 0.002  # the live loop yields to requests at least this often


class KVEventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        endpoints: Callable[[Iterable[str]], dict[str, Endpoints]],
        replicas: Callable[[], Iterable[str]],
        block_size: Callable[[str], int],
        *,
        topic: str = "",
        timeout_s: float = 10.0,
        replay_timeout_s: float = 2.0,
        reconnect_s: float = 2.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metrics: Any = None,
        leases: StreamLeases | None = None,
        settle_s: float | None = None,
        namespace: Callable[[str], str | None] | None = None,
    ) -> None:
        self.inner = index
        # Fleet mode: a stream this gateway does not own is applied to its local index only
        # (the resilient index's ``local``), and its writes logged for a later takeover.
        self.handle = IndexHandle.of(index)
        self.leases = leases
        self.index = PreciseIndex(index, self)
        self._endpoints = endpoints
        self._replicas = replicas
        self.topic = topic.encode()
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.max_message_bytes = max_message_bytes
        self.metrics = metrics
        self._streams: dict[str, Stream] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tick: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._pending: set[asyncio.Task[Any]] = set()
        self._unhealthy: set[str] = set()  # replicas in a health gap (a restart, maybe)
        self.applier = Applier(
            self.handle, block_size, self._count, self.capacity_for, namespace=namespace
        )
        self.replayer = Replayer(
            lambda: self._ctx,
            self.applier.apply,
            self._count,
            timeout_s=replay_timeout_s,
            max_message_bytes=max_message_bytes,
        )
        self.position = Position(self.applier, self.replayer, retry_s=2 * replay_timeout_s)
        # How long after a request's outcome its placement is checked against the events:
        # the events are published before the first token, so this only covers the lag.
        self.checks = Checks(
            self.handle,
            metrics,
            timeout_s=timeout_s,
            settle_s=min(1.0, timeout_s / 2) if settle_s is None else settle_s,
            changed=self._changed.set,
        )
        self.takeovers = (
            Takeovers(
                leases,
                self.handle,
                lambda: self._streams,
                self.capacity_for,
                self._owned_gauge,
                self._changed.set,
            )
            if leases is not None
            else None
        )

    @property
    def streams(self) -> dict[str, Stream]:
        return self._streams

    @property
    def local(self) -> PrefixIndex:
        return self.handle.local

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sync()
        self._tick = asyncio.create_task(self._ticker())
        if self.leases is not None and self.takeovers is not None:
            self.leases.start(self.takeovers.tick)

    async def stop(self, *, release: bool = True) -> None:
        """Close every stream. ``release``: give up this gateway's leases at once (a
        graceful stop); without it they expire, as after a crash."""
        if self.leases is not None:
            await self.leases.stop()
            owned = [u for u, s in self._streams.items() if s.owned]
            for s in self._streams.values():
                s.owned = False
            if release:
                await self.leases.release(owned)
        if self._tick is not None:
            self._tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick
        for task in list(self._pending):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for url in list(self._streams):
            await self._close(self._streams.pop(url))
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def sync(self) -> None:
        """Follow the fleet: a stream per replica, opened and closed as replicas come and go."""
        urls = list(self._replicas())
        wanted = self._endpoints(urls)
        for url in list(self._streams):
            if url not in wanted:
                self._spawn(self._close(self._streams.pop(url)))
        for url, eps in wanted.items():
            if url not in self._streams:
                stream = self._streams[url] = Stream(url, eps, owned=self.leases is None)
                self._connect(stream)
                self._gauge(stream)
                self._owned_gauge(stream)

    def _connect(self, stream: Stream) -> None:
        assert self._ctx is not None
        sub = stream.sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # bigger: ZMQ drops the peer
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        stream.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        stream.disconnected_since = time.monotonic()
        try:
            sub.connect(stream.endpoints.pub)
        except zmq.ZMQError as e:
            log.warning(
                "KV events for %s: cannot connect to %r: %s", stream.url, stream.endpoints.pub, e
            )
            self._count(stream, "endpoint")
        stream.tasks = [
            asyncio.create_task(self._watch(stream)),
            asyncio.create_task(self._consume(stream)),
        ]

    async def _close(self, stream: Stream) -> None:
        for task in stream.tasks:
            task.cancel()
        for task in stream.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        stream.tasks = []
        if stream.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                stream.sub.disable_monitor()
            if stream.monitor is not None:
                stream.monitor.close(linger=0)
                stream.monitor = stream.monitor_sync = None
            stream.sub.close(linger=0)
            stream.sub = None
        stream.connected = False

    async def _reconnect(self, stream: Stream) -> None:
        """A new SUB socket, the stream's state kept. ZMQ reconnects by itself after a lost
        connection, but not after a protocol error (e.g. a message over MAXMSGSIZE)."""
        await self._close(stream)
        if self._streams.get(stream.url) is stream and self._ctx is not None:
            self._connect(stream)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- state ----------------------------------------------------------------------------
    def state(self, url: str) -> dict[str, Any] | None:
        stream = self._streams.get(url)
        return stream.state() if stream else None

    def is_up(self, url: str) -> bool:
        stream = self._streams.get(url)
        return bool(stream and stream.up)

    def _gauge(self, stream: Stream) -> None:
        if self.metrics is not None:
            self.metrics.kv_events_up.labels(stream.url).set(1 if stream.up else 0)

    def _owned_gauge(self, stream: Stream) -> None:
        if self.metrics is not None:
            self.metrics.kv_event_stream_owned.labels(stream.url).set(1 if stream.owned else 0)

    def _count(self, stream: Stream, reason: str, n: int = 1) -> None:
        stream.errors[reason] = stream.errors.get(reason, 0) + n
        if self.metrics is not None:
            self.metrics.kv_events_errors.labels(stream.url, reason).inc(n)

    async def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checked after every applied batch or state
        change (tests, and the benchmark)."""

        async def until() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)

    # -- liveness -------------------------------------------------------------------------
    def _evaluate(self, stream: Stream, now: float) -> None:
        stale = stream.expect_since is not None and now - stream.expect_since > self.timeout_s
        up = stream.connected and not stale
        if up == stream.up:
            return
        stream.up = up
        log.log(
            logging.INFO if up else logging.WARNING,
            "KV events for %s %s",
            stream.url,
            "flowing: precise mode"
            if up
            else (
                "silent after placements: approximate mode"
                if stream.connected
                else "publisher gone: approximate mode"
            ),
        )
        self._gauge(stream)
        self._changed.set()
        self._spawn(self._on_up_change(stream))

    async def _on_up_change(self, stream: Stream) -> None:
        """Down: the index is sized as the replica (the approximate model's LRU). Up again:
        rebuilt from what the events say is held, whatever that LRU trimmed meanwhile."""
        async with stream.lock:
            if stream.up:
                await self.applier.rebuild(stream)
            elif stream.capacity is not None:
                cap = self.capacity_for(stream, stream.capacity)
                with contextlib.suppress(Exception):
                    await do(self.handle.target(stream), stream.url, ("capacity", [cap]))
        self._changed.set()

    def capacity_for(self, stream: Stream, blocks_: int) -> int:
        """The index's capacity for a replica reporting ``blocks_``. In precise mode events
        decide what is held, and an LRU trim by the replica's size would drop held blocks
        whenever the index's recency order differs from the replica's free queue (it does):
        twice the size leaves room for placements the events have yet to confirm. On the
        approximate model, the replica's size."""
        return blocks_ * 2 if stream.up else blocks_

    async def _ticker(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self.sync()
                now = time.monotonic()
                for stream in list(self._streams.values()):
                    waited = now - stream.expect_since if stream.expect_since else 0.0
                    # Silence after a placement: a lost last message, a dead publisher, or
                    # one with nothing to say (the request stored nothing new); the replay
                    # socket tells which, and catches up.
                    silent = stream.up and waited > self.timeout_s / 2
                    if silent and stream.endpoints.replay and await self.catch_up(stream.url):
                        stream.expect_since = None
                    self._evaluate(stream, now)
                    await self.checks.check(stream, now)
                    gone = stream.disconnected_since
                    if not stream.connected and gone and now - gone > self.reconnect_s:
                        await self._reconnect(stream)
            except Exception:
                log.exception("KV event bookkeeping failed")

    # -- position -------------------------------------------------------------------------
    async def catch_up(self, url: str) -> bool:
        """Replay whatever followed the last applied batch (a lost message with nothing after
        it shows no gap on the live socket), checking the publisher is still the same one.
        True when the replay answered."""
        stream = self._streams.get(url)
        if stream is None:
            return False
        async with stream.lock:
            ok = await self.position.catch_up(stream)
        self._evaluate(stream, time.monotonic())
        self._changed.set()
        return ok

    async def restart(self, stream: Stream, why: str) -> None:
        """The replica restarted (or its index was dropped): resync from its new publisher's
        seq 0."""
        async with stream.lock:
            await self.position.resync(stream, why)
        self._changed.set()

    def on_fleet_event(self, url: str, event: str) -> None:
        """The fleet's view of a replica: a health gap may hide a restart the stream has not
        shown (a new process that already passed the old seq): check through the replay."""
        stream = self._streams.get(url)
        if event == "removed" and stream is not None:
            # Gone from the fleet: closed now (a resync would wait on a replica that left).
            del self._streams[url]
            self._spawn(self._close(stream))
        elif event == "unhealthy":
            self._unhealthy.add(url)
        elif event == "healthy" and url in self._unhealthy:
            self._unhealthy.discard(url)
            if stream is not None:
                stream.verified = False
                stream.doubt = True
                self._spawn(self.catch_up(url))

    # -- placements -----------------------------------------------------------------------
    def placed(self, url: str) -> None:
        stream = self._streams.get(url)
        if stream is not None and stream.expect_since is None:
            stream.expect_since = time.monotonic()

    def expect(self, stream: Stream, block_hashes: Sequence[int]) -> None:
        self.checks.expect(stream, block_hashes)

    def settle(self, url: str, block_hashes: Sequence[int]) -> None:
        """The request placed with ``block_hashes`` on ``url`` was answered (or failed)."""
        stream = self._streams.get(url)
        if stream is not None:
            self.checks.settle(stream, block_hashes)

    def reject(self, url: str, block_hashes: Sequence[int]) -> None:
        """The replica refused the request placed with ``block_hashes`` (a 4xx)."""
        stream = self._streams.get(url)
        if stream is not None:
            self._spawn(self.checks.reject(stream, block_hashes))

    # -- the live stream ------------------------------------------------------------------
    def _drain_monitor(self, stream: Stream) -> None:
        """Apply the socket monitor's pending events now: a message from a reconnected
        (maybe restarted) publisher must not be applied before its disconnect is seen."""
        monitor = stream.monitor
        if monitor is None:
            return
        sync = stream.monitor_sync
        if sync is None:
            sync = stream.monitor_sync = zmq.Socket.shadow(monitor.underlying)
        while True:
            try:
                frames = sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            connected = parse_monitor_message(frames)["event"] == zmq.EVENT_CONNECTED
            if connected == stream.connected:
                continue
            stream.connected = connected
            stream.verified = False  # a new connection may be a new publisher: check first
            stream.doubt = stream.doubt or (connected and stream.disconnects > 0)
            if connected:
                stream.disconnected_since = None
                if stream.endpoints.replay:
                    self._spawn(self._check_position(stream))
            else:
                stream.disconnects += 1
                stream.disconnected_since = time.monotonic()
            self._evaluate(stream, time.monotonic())
            self._changed.set()

    async def _check_position(self, stream: Stream) -> None:
        async with stream.lock:
            if not stream.verified:
                await self.position.catch_up(stream)
        self._evaluate(stream, time.monotonic())
        self._changed.set()

    async def _watch(self, stream: Stream) -> None:
        monitor = stream.monitor
        assert monitor is not None
        while True:
            await monitor.poll()
            self._drain_monitor(stream)

    async def _consume(self, stream: Stream) -> None:
        sub = stream.sub
        assert sub is not None
        yielded = time.perf_counter()
        while True:
            frames = await sub.recv_multipart()
            self._drain_monitor(stream)
            stream.expect_since = None
            try:
                if len(frames) != 3:
                    raise WireError("frames", f"{len(frames)} frames")
                seq, payload = parse_frames(frames)
            except WireError as e:
                self._count(stream, e.reason)  # junk: counted and dropped, nothing else
            else:
                await self._live(stream, seq, payload)
            if time.perf_counter() - yielded > YIELD_S:
                await asyncio.sleep(0)  # a burst of messages yields to requests
                yielded = time.perf_counter()

    async def _live(self, stream: Stream, seq: int, payload: bytes) -> None:
        try:
            async with stream.lock:
                await self.position.live(stream, seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not end the stream
            log.exception("KV event %d from %s not applied", seq, stream.url)
            self._count(stream, "internal")
        now = time.monotonic()
        self._evaluate(stream, now)
        if not self.checks.behind(stream):  # caught up: placements due are checked now
            try:
                await self.checks.check(stream, now)
            except Exception:  # as above: never the end of the stream
                log.exception("placements on %s not checked", stream.url)
        self._changed.set()
