"""The subscriber: one ZMQ SUB socket per replica, sequence checks and replay, and the
events applied to the index (see the package doc for the rules)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router import blocks
from router.index.base import PrefixIndex
from router.kv_events.ownership import StreamLeases
from router.kv_events.precise_index import PreciseIndex
from router.kv_events.streams import Endpoints, Op, Stream
from router.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Hash,
    Skipped,
    WireError,
    decode_batch,
    parse_frames,
)

log = logging.getLogger("prefix_router.kv_events")

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
RESYNC_CHUNK = 2048  # blocks per shared write when a takeover rewrites a replica's entry
MEMO_ENTRIES = 65_536  # vLLM -> gateway hashes of recently removed blocks (see _parent)
PLACED_BLOCKS = 65_536  # unconfirmed placement blocks per replica of unknown size


class KVEventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        endpoints: Callable[[Iterable[str]], dict[str, Endpoints]],
        replicas: Callable[[], Iterable[str]],
        block_size: Callable[[], int],
        *,
        topic: str = "",
        timeout_s: float = 10.0,
        replay_timeout_s: float = 2.0,
        reconnect_s: float = 2.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metrics: Any = None,
        leases: StreamLeases | None = None,
        settle_s: float | None = None,
    ) -> None:
        self.inner = index
        # Fleet mode: a stream this gateway does not own is applied to its local index only
        # (a ResilientIndex's ``local``), and its writes logged for a later takeover.
        self.leases = leases
        self.local: PrefixIndex = getattr(index, "local", index) if leases else index
        self._transitions = getattr(index, "transitions", 0)
        self.index = PreciseIndex(index, self)
        self._endpoints = endpoints
        self._replicas = replicas
        self._block_size = block_size
        self.topic = topic.encode()
        self.timeout_s = timeout_s
        # How long after a request's outcome its placement is checked against the events
        # (router/kv_events/placements.py): the events are published before the first token,
        # so this only covers the stream's lag.
        self.settle_s = min(1.0, timeout_s / 2) if settle_s is None else settle_s
        self.replay_timeout_s = replay_timeout_s
        self.reconnect_s = reconnect_s
        self.max_message_bytes = max_message_bytes
        self.metrics = metrics
        self.streams: dict[str, Stream] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tick: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._pending: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sync()
        self._tick = asyncio.create_task(self._ticker())
        if self.leases is not None:
            self.leases.start(self.lease_tick)

    async def stop(self, *, release: bool = True) -> None:
        """Close every stream. ``release``: give up this gateway's leases at once (a
        graceful stop); without it they expire, as after a crash."""
        if self.leases is not None:
            await self.leases.stop()
            owned = [u for u, s in self.streams.items() if s.owned]
            for s in self.streams.values():
                s.owned = False
            if release:
                await self.leases.release(owned)
        if self._tick is not None:
            self._tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick
        for task in list(self._pending):
            with contextlib.suppress(Exception):
                await task
        for url in list(self.streams):
            await self._close(self.streams.pop(url))
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def sync(self) -> None:
        """Follow the fleet: a stream per replica, opened and closed as replicas come and go."""
        urls = list(self._replicas())
        wanted = self._endpoints(urls)
        for url in list(self.streams):
            if url not in wanted:
                stream = self.streams.pop(url)
                asyncio.get_running_loop().create_task(self._close(stream))
        for url, eps in wanted.items():
            if url not in self.streams:
                self.streams[url] = self._open(url, eps)

    def _open(self, url: str, eps: Endpoints) -> Stream:
        stream = Stream(url, eps, owned=self.leases is None)
        self._connect(stream)
        self._gauge(stream)
        self._owned_gauge(stream)
        return stream

    def _connect(self, stream: Stream) -> None:
        assert self._ctx is not None
        sub = stream.sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # bigger: ZMQ drops the peer
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        stream.disconnected_since = time.monotonic()
        try:
            sub.connect(stream.endpoints.pub)
        except zmq.ZMQError as e:
            log.warning(
                "KV events for %s: cannot connect to %r: %s", stream.url, stream.endpoints.pub, e
            )
            self._count(stream, "endpoint")
        stream.tasks = [
            asyncio.create_task(self._watch(stream, monitor)),
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
            stream.sub.close(linger=0)
            stream.sub = None
        stream.connected = False

    async def _reconnect(self, stream: Stream) -> None:
        """A new SUB socket, the stream's state kept. ZMQ reconnects by itself after a lost
        connection, but not after a protocol error (e.g. a message over MAXMSGSIZE)."""
        await self._close(stream)
        if self.streams.get(stream.url) is stream and self._ctx is not None:
            self._connect(stream)

    # -- state ----------------------------------------------------------------------------
    def state(self, url: str) -> dict[str, Any] | None:
        stream = self.streams.get(url)
        return stream.state() if stream else None

    def is_up(self, url: str) -> bool:
        stream = self.streams.get(url)
        return bool(stream and stream.up)

    def _gauge(self, stream: Stream) -> None:
        if self.metrics is not None:
            self.metrics.kv_events_up.labels(stream.url).set(1 if stream.up else 0)

    def _owned_gauge(self, stream: Stream) -> None:
        if self.metrics is not None:
            self.metrics.kv_event_stream_owned.labels(stream.url).set(1 if stream.owned else 0)

    def _count(self, stream: Stream, reason: str) -> None:
        stream.errors[reason] = stream.errors.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.kv_events_errors.labels(stream.url, reason).inc()

    def _evaluate(self, stream: Stream, now: float) -> None:
        stale = stream.expect_since is not None and now - stream.expect_since > self.timeout_s
        up = stream.connected and not stale
        if up != stream.up:
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
            if stream.capacity is not None:
                task = asyncio.get_running_loop().create_task(self._apply_capacity(stream))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    def capacity_for(self, stream: Stream, blocks_: int) -> int:
        """The index's capacity for a replica reporting ``blocks_``. In precise mode events
        decide what is held, and an LRU trim by the replica's size would drop held blocks
        whenever the index's recency order differs from the replica's free queue (it does):
        twice the size leaves room for placements the events have yet to confirm. On the
        approximate model, the replica's size."""
        return blocks_ * 2 if stream.up else blocks_

    async def _apply_capacity(self, stream: Stream) -> None:
        if stream.capacity is not None:
            with contextlib.suppress(Exception):
                await (self.inner if stream.owned else self.local).set_capacity(
                    stream.url, self.capacity_for(stream, stream.capacity)
                )

    async def _ticker(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self.sync()
                now = time.monotonic()
                for stream in list(self.streams.values()):
                    waited = now - stream.expect_since if stream.expect_since else 0.0
                    if stream.endpoints.replay and stream.up and waited > self.timeout_s / 2:
                        # Silence after a placement: a lost last message, or a dead
                        # publisher; the replay socket tells which (and catches up).
                        await self.catch_up(stream.url)
                    self._evaluate(stream, now)
                    await self.retract(stream, now)
                    gone = stream.disconnected_since
                    if not stream.connected and gone and now - gone > self.reconnect_s:
                        await self._reconnect(stream)
            except Exception:
                log.exception("KV event bookkeeping failed")

    async def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checked after every applied batch or state
        change (tests, and the benchmark)."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    async def catch_up(self, url: str) -> bool:
        """Replay whatever followed the last applied batch (a lost message with nothing after
        it shows no gap on the live socket). True when the replay answered."""
        stream = self.streams.get(url)
        if stream is None:
            return False
        async with stream.lock:
            last = stream.last_applied
            ok = await self._replay(stream, 0 if last is None else last + 1)
            if stream.last_applied != last:
                stream.expect_since = None
        self._evaluate(stream, time.monotonic())
        self._changed.set()
        return ok

    def placed(self, url: str) -> None:
        stream = self.streams.get(url)
        if stream is not None and stream.expect_since is None:
            stream.expect_since = time.monotonic()

    # -- placements the events have yet to confirm -----------------------------------------
    def expect(self, stream: Stream, block_hashes: Sequence[int]) -> None:
        """A placement: checked against the events ``timeout_s`` from now, or ``settle_s``
        after its request's outcome (``settle``), whichever first. (One made while the stream
        is down is checked too if the events are back by then: a replica restarting.)"""
        stream.placements.add(time.monotonic() + self.timeout_s, block_hashes)

    def settle(self, url: str, block_hashes: Sequence[int]) -> None:
        """The request placed with ``block_hashes`` on ``url`` was answered (or failed)."""
        stream = self.streams.get(url)
        if stream is not None:
            stream.placements.settle(time.monotonic() + self.settle_s, block_hashes)

    def placement_limit(self, stream: Stream) -> int:
        """Blocks of unconfirmed placements kept per replica: its size (twice over, a block
        being counted by each placement of it), so the index stays within twice the size."""
        return 2 * stream.capacity if stream.capacity else PLACED_BLOCKS

    @staticmethod
    def _behind(stream: Stream) -> bool:
        """Events received but not applied yet: a batch being applied, or messages waiting
        on the SUB socket. (In fleet mode the owner may already have written them to Redis,
        where a retraction now would undo its record.)"""
        if stream.lock.locked():
            return True
        sub = stream.sub
        try:
            return sub is not None and bool(int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    async def retract(self, stream: Stream, now: float) -> None:
        """Retract what the placements now due recorded and the events do not hold: a
        request the replica failed or never computed, a record that landed after the block's
        removal. Down, the approximate model keeps them (placements are all it has)."""
        due = stream.placements.due(now, self.placement_limit(stream))
        if not due or not stream.up:
            return
        if self._behind(stream):  # the confirming events may be waiting: not yet
            for hashes in due:
                stream.placements.add(now + self.settle_s, hashes)
            return
        held = stream.gw_holders
        gone = list(dict.fromkeys(h for hashes in due for h in hashes if h not in held))
        if not gone:
            return
        # Counted: those still in the local copy (the rest the events already removed).
        # Forgotten: all of them, for a shared index where a placement's record may have
        # landed after the owner's removal. The local copy's reads and write do not suspend,
        # so no event is applied in between.
        local = getattr(self.inner, "local", self.inner)
        url = stream.url
        lingering = sum([(await local.match([h], [url])).get(url, 0) for h in gone])
        stream.placements.retracted += lingering
        if self.metrics is not None and lingering:
            self.metrics.kv_events_retracted.labels(url).inc(lingering)
        if not getattr(self.inner, "redis_up", True):
            # The shared index would skip the write: the local copy now, the whole check
            # again later (what is then still not held is forgotten in Redis too).
            await local.forget(url, gone)
            for hashes in due:
                stream.placements.add(now + self.settle_s, hashes)
        else:
            # Logged: a takeover's catch-up replays it like the events' writes.
            stream.oplog.append(("~", [("forget", gone)]))
            await self.inner.forget(url, gone)
        self._changed.set()

    # -- the stream -----------------------------------------------------------------------
    async def _watch(self, stream: Stream, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                msg = parse_monitor_message(await monitor.recv_multipart())
                connected = msg["event"] == zmq.EVENT_CONNECTED
                if connected != stream.connected:
                    stream.connected = connected
                    stream.disconnects += not connected
                    stream.disconnected_since = None if connected else time.monotonic()
                    self._evaluate(stream, time.monotonic())
                    self._changed.set()
        finally:
            monitor.close(linger=0)

    async def _consume(self, stream: Stream) -> None:
        assert stream.sub is not None
        if stream.endpoints.replay:
            # Whatever the publisher still buffers from seq 0 (or what followed the last
            # batch, on a reconnect): a gateway started after the replica learns its cache
            # from the start, if the buffer reaches back that far.
            async with stream.lock:
                last = stream.last_applied
                await self._replay(stream, 0 if last is None else last + 1)
        while True:
            frames = await stream.sub.recv_multipart()
            stream.expect_since = None
            try:
                if len(frames) != 3:
                    raise WireError("frames", f"{len(frames)} frames")
                seq, payload = parse_frames(frames)
            except WireError as e:
                self._count(stream, e.reason)
                continue
            try:
                async with stream.lock:
                    await self._live(stream, seq, payload)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the stream
                log.exception("KV event %d from %s not applied", seq, stream.url)
                self._count(stream, "internal")
            now = time.monotonic()
            self._evaluate(stream, now)
            if not self._behind(stream):  # caught up: placements due are checked now
                try:
                    await self.retract(stream, now)
                except Exception:  # as above: never the end of the stream
                    log.exception("placements on %s not checked", stream.url)
            self._changed.set()
            await asyncio.sleep(0)  # a burst of events yields to requests

    async def _live(self, stream: Stream, seq: int, payload: bytes) -> None:
        if stream.live_seq is not None and seq <= stream.live_seq:
            await self._reset(stream, f"publisher restarted (seq {seq} after {stream.live_seq})")
            stream.last_applied = -1  # a new process: its stream starts at 0
        stream.live_seq = seq
        last = stream.last_applied
        if last is None:  # the first message, and no replay found earlier ones: join here
            await self._apply(stream, seq, payload)
            return
        if seq <= last:
            return  # already applied from a replay
        if seq > last + 1:
            await self._replay(stream, last + 1)
            last = stream.last_applied
            assert last is not None
            if seq <= last:
                return
            if seq != last + 1:
                await self._reset(stream, f"batches {last + 1}..{seq - 1} lost, not replayable")
        await self._apply(stream, seq, payload)

    async def _replay(self, stream: Stream, start: int) -> bool:
        """Ask the replay socket for every batch from ``start`` and apply, in order, those
        that follow what was applied. False when it could not (no replay endpoint, no answer
        within ``replay_timeout_s``, a hole the publisher's buffer no longer covers)."""
        if not stream.endpoints.replay or self._ctx is None:
            return False
        stream.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.replay_timeout_s) as deadline:
                sock.connect(stream.endpoints.replay)
                await sock.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await sock.recv_multipart()
                    deadline.reschedule(loop.time() + self.replay_timeout_s)
                    try:
                        if not frames or frames[0] != b"":
                            raise WireError("frames", "replay reply without delimiter")
                        seq, payload = parse_frames(frames[1:])
                    except WireError as e:
                        self._count(stream, e.reason)
                        continue
                    if seq < 0:
                        return True
                    last = stream.last_applied
                    if last is not None and seq <= last:
                        continue
                    if last is not None and seq != last + 1:
                        return False  # a hole the buffer no longer covers
                    await self._apply(stream, seq, payload)
        except TimeoutError:
            self._count(stream, "replay_timeout")
            return False
        except zmq.ZMQError as e:
            log.debug("replay from %s failed: %s", stream.url, e)
            self._count(stream, "replay_error")
            return False
        finally:
            sock.close(linger=0)

    async def _reset(self, stream: Stream, why: str) -> None:
        log.info("KV events for %s: %s; dropping its index entries", stream.url, why)
        stream.resets += 1
        self._forget_holders(stream)
        await self._write(stream, ("drop", []))
        if stream.capacity is not None:
            await self._write(stream, ("capacity", [self.capacity_for(stream, stream.capacity)]))

    def restart(self, stream: Stream) -> None:
        """Forget the stream's position and holders: its replica restarted (a new publisher
        numbers from 0 again, which the live socket may not have shown) or its index was
        dropped. What the publisher still buffers is replayed from 0, rebuilding the index."""
        self._forget_holders(stream)
        stream.oplog.append(("~", [("drop", [])]))  # a catch-up must not carry the old cache over
        stream.last_applied = stream.live_seq = None
        if stream.endpoints.replay:
            task = asyncio.get_running_loop().create_task(self.catch_up(stream.url))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _forget_holders(self, stream: Stream) -> None:
        memo = stream.memo
        for vh, (gh, _) in stream.held.items():
            memo[vh] = gh
        while len(memo) > MEMO_ENTRIES:
            memo.popitem(last=False)
        stream.held.clear()
        stream.gw_holders.clear()
        stream.placements.clear()  # the entry is dropped: nothing of theirs to retract

    # -- applying events ------------------------------------------------------------------
    async def _apply(self, stream: Stream, seq: int, payload: bytes) -> None:
        stream.last_applied = seq
        stream.batches += 1
        ops: list[Op] = []
        stream.oplog.append((f"{seq}:{zlib.crc32(payload)}", ops))
        stream.applying = True
        shared = stream.owned
        try:
            events = decode_batch(payload)
        except WireError as e:
            self._count(stream, e.reason)
            events = []
        for event in events:
            if isinstance(event, BlockStored):
                await self._stored(stream, event)
            elif isinstance(event, BlockRemoved):
                await self._removed(stream, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                await self._reset(stream, "AllBlocksCleared")
            elif isinstance(event, Skipped):
                self._count(stream, event.reason)
        stream.applying = False
        # The batch's writes, after its events: one round trip per write, and a batch of
        # evictions (one BlockRemoved per block) is a single forget, not one per block.
        # Written one by one, a busy replica's stream fell behind by ~100 batches, and the
        # index kept blocks the replica had long evicted (mispredicted +0.2).
        index = self.inner if stream.owned else self.local
        for op in ops:
            await self._do(index, stream.url, op)
        stream.written = stream.oplog[-1][0]
        stream.shared_batches += shared and bool(ops)

    async def _write(self, stream: Stream, op: Op) -> None:
        """One index write: inside a batch, queued for the batch's end (consecutive forgets
        merged); between batches (a reset), done now. To the shared index when this gateway
        owns the stream, else to the local one; logged either way."""
        if stream.applying:
            ops = stream.oplog[-1][1]
            if op[0] == "forget" and ops and ops[-1][0] == "forget":
                ops[-1][1].extend(op[1])  # removals commute: one write
            else:
                ops.append((op[0], list(op[1])))
            return
        stream.oplog.append(("~", [op]))  # a reset between batches: an entry no stamp names
        await self._do(self.inner if stream.owned else self.local, stream.url, op)

    @staticmethod
    async def _do(index: PrefixIndex, url: str, op: Op) -> None:
        kind, arg = op
        if kind == "record":
            await index.record(url, arg)
        elif kind == "forget":
            await index.forget(url, arg)
        elif kind == "drop":
            await index.drop_replica(url)
        elif kind == "capacity":
            await index.set_capacity(url, arg[0])

    # -- fleet mode: ownership -------------------------------------------------------------
    async def lease_tick(self) -> None:
        """Renew, claim or lose each stream's lease (router/kv_events/ownership.py); a stream
        newly owned is caught up into the shared index first."""
        leases = self.leases
        assert leases is not None
        transitions = getattr(self.inner, "transitions", 0)
        if transitions != self._transitions or not getattr(self.inner, "redis_up", True):
            # Shared writes were skipped meanwhile: owned streams catch up as on a takeover.
            self._transitions = transitions
            for stream in self.streams.values():
                stream.owned = False
        streams = dict(self.streams)
        up = getattr(self.inner, "redis_up", True)
        wanted = {  # no claims while shared writes would be skipped: a catch-up must land
            url: (leases.mode(url, s.owned) if up else "peek", s.written if s.owned else "")
            for url, s in streams.items()
        }
        views = await leases.tick(wanted)
        if views is None:
            for stream in streams.values():
                stream.owned = False
                self._owned_gauge(stream)
            self._changed.set()
            return
        for url, view in views.items():
            stream = streams[url]
            stream.holder = view.holder
            if view.mine and not stream.owned:
                await self._take_over(stream, view.stamp)
            elif not view.mine and stream.owned:
                log.info("KV events for %s: now written by gateway %s", url, view.holder)
                stream.owned = False
        for stream in streams.values():
            self._owned_gauge(stream)
        self._changed.set()

    async def _take_over(self, stream: Stream, stamp: str) -> None:
        """Bring the shared index up to this gateway's view of the stream: replay the logged
        writes of the batches after ``stamp`` (the last batch the previous owner wrote), or,
        when the log does not reach back to it, rewrite the replica's shared entry."""
        transitions = getattr(self.inner, "transitions", 0)
        async with stream.lock:
            log_ = list(stream.oplog)
            at = next((i for i in range(len(log_) - 1, -1, -1) if log_[i][0] == stamp), None)
            if at is not None:
                for _, ops in log_[at + 1 :]:
                    for op in ops:
                        await self._do(self.inner, stream.url, op)
                stream.caught_up += len(log_) - at - 1
            else:
                await self._resync(stream)
            if stream.capacity is not None:  # the shared entry sized as this gateway sizes it
                await self.inner.set_capacity(
                    stream.url, self.capacity_for(stream, stream.capacity)
                )
            if getattr(self.inner, "transitions", 0) != transitions:
                return  # Redis failed meanwhile: writes were lost; the next tick tries again
            stream.owned = True
            stream.takeovers += 1
        log.info(
            "KV events for %s: this gateway writes them now (%s)",
            stream.url,
            "caught up from the log" if at is not None else "shared entry rewritten",
        )

    async def _resync(self, stream: Stream) -> None:
        stream.resyncs += 1
        write = getattr(self.inner, "write_primary", None)
        primary = getattr(self.inner, "primary", None)
        if write is None or primary is None:
            return
        url = stream.url
        await write("resync", lambda: primary.drop_replica(url))
        held = list(stream.gw_holders)
        for i in range(0, len(held), RESYNC_CHUNK):
            chunk = held[i : i + RESYNC_CHUNK]
            await write("resync", lambda chunk=chunk: primary.record(url, chunk))

    def _parent(self, stream: Stream, vh: Hash) -> int | None:
        entry = stream.held.get(vh)
        if entry is not None:
            return entry[0]
        # A parent we stopped counting (a reset, a removal event of one of two holders that
        # raced) still names the same tokens: the mapping is a function of the chain.
        return stream.memo.get(vh)

    async def _stored(self, stream: Stream, ev: BlockStored) -> None:
        if ev.block_size != self._block_size():
            self._count(stream, "block_size")
            return
        if ev.parent_block_hash is None:
            parent = blocks.root_hash(ev.cache_salt(), ev.lora_name)
        else:
            found = self._parent(stream, ev.parent_block_hash)
            if found is None:
                self._count(stream, "unknown_parent")
                return
            parent = found
        gws = blocks.continue_chain(parent, ev.token_ids, ev.block_size)
        held, gw_holders = stream.held, stream.gw_holders
        for vh, gh in zip(ev.block_hashes, gws, strict=True):
            entry = held.get(vh)
            if entry is None:
                held[vh] = [gh, 1]
                gw_holders[gh] = gw_holders.get(gh, 0) + 1
            else:
                entry[1] += 1
        await self._write(stream, ("record", gws))

    async def _removed(self, stream: Stream, hashes: Sequence[Hash]) -> None:
        held, gw_holders = stream.held, stream.gw_holders
        gone = []
        for vh in hashes:
            entry = held.get(vh)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] > 0:
                continue
            del held[vh]
            gh = entry[0]
            stream.memo[vh] = gh
            n = gw_holders.get(gh, 0) - 1
            if n > 0:
                gw_holders[gh] = n
            else:
                gw_holders.pop(gh, None)
                gone.append(gh)
        while len(stream.memo) > MEMO_ENTRIES:
            stream.memo.popitem(last=False)
        if gone:
            await self._write(stream, ("forget", gone))
