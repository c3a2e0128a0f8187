"""vLLM's ZMQ KV-event publisher (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``),
reimplemented for the simulator: the same sockets, framing and msgpack layout, so a gateway
tested against the simulator reads a real vLLM's stream the same way.

* PUB socket, one multipart message per engine step with events:
  ``(topic, seq as 8-byte big-endian, payload)``, seq counting from 0;
* payload: msgspec's encoding of ``EventBatch`` (``array_like``): ``[ts, events, dp_rank]``;
  each event a map tagged ``"type"`` first, then its fields in declaration order, fields equal
  to their default omitted (the engine's block pool builds them in that shape);
* replay: a ROUTER socket; a request ``[identity, b"", start_seq]`` is answered with every
  buffered message with seq >= start as ``[identity, b"", topic, seq, payload]``, then the end
  marker ``[identity, b"", b"", seq -1, b""]`` (vLLM 0.34's replay frames carry the topic).

Endpoints are bound (the simulator is the server); ``tcp://127.0.0.1:*`` takes any free port
and ``endpoint`` / ``replay_endpoint`` then say which. Test hooks: ``skip_next(n)`` drops the
next ``n`` messages from the PUB socket while still numbering and buffering them (a subscriber
sees a gap it can replay), ``mute`` drops every message the same way, ``pause()`` /
``resume()`` close and reopen both sockets on the same ports while the engine goes on
numbering and buffering (a network outage: subscribers see a disconnect, then the same
publisher).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger("loadtest.sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's KVEventsConfig.buffer_steps


# Fields each event type declares, the tag included. msgspec writes a struct's map header
# for its declared size before omitting defaults: 16 or more fields get a map16 header even
# when fewer are written (BlockStored), smaller structs a fixmap.
_DECLARED_FIELDS = {"BlockStored": 16, "BlockRemoved": 6, "AllBlocksCleared": 1}


def _encode_event(event: dict[str, Any]) -> bytes:
    n = len(event)
    if _DECLARED_FIELDS.get(event["type"], n) > 15:
        head = b"\xde" + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | n])
    pack = msgpack.packb
    return head + b"".join(pack(k) + pack(v, use_bin_type=True) for k, v in event.items())


def encode_batch(events: list[dict[str, Any]], ts: float, dp_rank: int = 0) -> bytes:
    """``KVEventBatch`` byte for byte as vLLM's msgspec encoder writes it: an array
    (``array_like=True``) ``[ts, events, dp_rank]``."""
    n = len(events)
    head = bytes([0x90 | n]) if n < 16 else msgpack.packb([None] * n)[:-n]  # array header
    return (
        b"\x93"
        + msgpack.packb(ts)
        + head
        + b"".join(_encode_event(e) for e in events)
        + msgpack.packb(dp_rank)
    )


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        dp_rank: int = 0,
    ) -> None:
        self.requested = (endpoint, replay_endpoint)
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._seq = 0
        self._skip = 0
        self.mute = False
        self.paused = False
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._pub_async: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        await self._open(*self.requested)

    async def _open(self, endpoint: str, replay_endpoint: str | None) -> None:
        assert self._ctx is not None
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(100_000)
        self.endpoint = await _bind(pub, endpoint)
        # Sent from engine callbacks (synchronous code): a plain socket over the same handle.
        self._pub = zmq.Socket.shadow(pub.underlying)
        self._pub_async = pub
        if replay_endpoint:
            replay = self._replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = await _bind(replay, replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay())

    async def pause(self) -> None:
        """Close both sockets; messages are still numbered and buffered (not sent)."""
        self.paused = True
        await self._close_sockets()

    async def resume(self) -> None:
        """Reopen both sockets on the same ports: the same publisher, its buffer intact."""
        await self._open(self.endpoint, self.replay_endpoint)
        self.paused = False

    async def close(self) -> None:
        """Close both sockets at once, like a process that died."""
        await self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _close_sockets(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for sock in (self._replay, self._pub_async):
            if sock is not None:
                sock.close(linger=0)
        self._replay = self._pub = self._pub_async = None

    def keep_steps(self, n: int) -> None:
        """From now on the replay buffer holds only the last ``n`` messages."""
        self._buffer = deque(self._buffer, maxlen=max(1, n))

    def skip_next(self, n: int) -> None:
        """Number and buffer the next ``n`` messages but do not send them."""
        self._skip += n

    def publish(self, events: list[dict[str, Any]]) -> None:
        if self._ctx is None:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time(), self.dp_rank)
        self._buffer.append((seq, payload))
        if self._skip > 0:
            self._skip -= 1
            return
        if self.mute or self._pub is None:
            return
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # PUB drops at its high-water mark; so do we
            log.debug("KV event %d not sent: %s", seq, e)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))


async def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind, retrying briefly: a port closed a moment ago (a restart) is released by ZMQ's
    I/O thread asynchronously."""
    for attempt in range(50):
        try:
            sock.bind(endpoint)
            break
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or attempt == 49:
                raise
            await asyncio.sleep(0.02)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
