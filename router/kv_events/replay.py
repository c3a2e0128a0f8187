"""The publisher's replay socket (vLLM's ROUTER: ``[b"", start]`` is answered with every
buffered batch from ``start``, then an end marker): catching up, and telling this publisher
from another.

A replay starts at the last batch applied, not the one after it, so its first reply shows
whether the publisher still numbers the same stream: a restarted vLLM counts from 0 again and
may have passed the old seq before the gateway saw any of it. The batch at that seq must be
the one applied (same payload checksum; the payload carries the publisher's timestamp), and a
publisher with nothing at that seq is a new process behind it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from router.kv_events.streams import Stream
from router.kv_events.wire import WireError, digest, parse_frames

log = logging.getLogger("prefix_router.kv_events")

MAX_JUNK = 64  # unreadable replies before a replay is given up (a hostile publisher)
MAX_REPLIES = 100_000  # vLLM keeps 10,000 steps by default
YIELD_S = 0.005  # a long replay yields to the loop this often


class Replay(enum.Enum):
    ANSWERED = "answered"  # the end marker came: everything buffered was applied
    HOLE = "hole"  # the buffer no longer reaches the last batch applied
    OTHER_PUBLISHER = "other_publisher"  # the seq applied last is another batch there
    FAILED = "failed"  # no replay endpoint, no answer, or junk


Apply = Callable[[Stream, int, bytes], Awaitable[None]]


class Replayer:
    def __init__(
        self,
        context: Callable[[], zmq.asyncio.Context | None],
        apply: Apply,
        count: Callable[[Stream, str], None],
        *,
        timeout_s: float,
        max_message_bytes: int,
    ) -> None:
        self._context = context
        self._apply = apply
        self._count = count
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes

    async def replay(self, stream: Stream) -> Replay:
        """Ask for every batch from the last one applied (from seq 0 with none) and apply,
        in order, those that follow it. The caller holds ``stream.lock``."""
        ctx = self._context()
        if not stream.endpoints.replay or ctx is None:
            return Replay.FAILED
        stream.replays += 1
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        try:
            return await self._run(stream, sock)
        except TimeoutError:
            self._count(stream, "replay_timeout")
            return Replay.FAILED
        except zmq.ZMQError as e:
            log.debug("replay from %s failed: %s", stream.url, e)
            self._count(stream, "replay_error")
            return Replay.FAILED
        finally:
            sock.close(linger=0)

    async def _run(self, stream: Stream, sock: zmq.asyncio.Socket) -> Replay:
        last, crc = stream.last_applied, stream.last_crc
        check = last is not None and crc is not None  # the batch at ``last`` must match
        matched = False
        junk = replies = 0
        yielded = time.perf_counter()
        loop = asyncio.get_running_loop()
        assert stream.endpoints.replay is not None
        sock.connect(stream.endpoints.replay)
        start = 0 if last is None else last
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = loop.time() + self.timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await sock.poll(remaining * 1000):
                raise TimeoutError
            frames = await sock.recv_multipart()
            deadline = loop.time() + self.timeout_s
            replies += 1
            if replies > MAX_REPLIES:
                self._count(stream, "replay_too_long")
                return Replay.FAILED
            if time.perf_counter() - yielded > YIELD_S:
                await asyncio.sleep(0)  # recv of a ready message never yields by itself
                yielded = time.perf_counter()
            try:
                if not frames or frames[0] != b"":
                    raise WireError("frames", "replay reply without delimiter")
                seq, payload = parse_frames(frames[1:])
            except WireError as e:
                self._count(stream, e.reason)
                junk += 1
                if junk > MAX_JUNK:
                    return Replay.FAILED
                continue
            if seq < 0:
                # Nothing at or after the seq applied last: a publisher behind us.
                return Replay.OTHER_PUBLISHER if check and not matched else Replay.ANSWERED
            if check and not matched and last is not None:
                if seq < last:
                    continue
                if seq == last:
                    if digest(payload) != crc:
                        return Replay.OTHER_PUBLISHER
                    matched = True
                    continue
                if stream.doubt:
                    return Replay.HOLE  # cannot tell this publisher from another
                matched = True  # the same publisher (nothing said otherwise), batch gone
            current = stream.last_applied
            if current is not None and seq <= current:
                continue
            if current is not None and seq != current + 1:
                return Replay.HOLE
            if current is None and seq != 0:
                self._count(stream, "replay_incomplete")  # its buffer no longer has seq 0
            await self._apply(stream, seq, payload)
