"""Where a stream is in its publisher's sequence: live messages applied in order, gaps
replayed, restarts noticed and resynced from the new publisher's seq 0.

A restart shows as the live seq going backwards, a replay whose batch at our last seq is
another one (or missing), a reconnected socket (checked through the replay before anything
live is applied), the replica's health gap or its counters reset (the fleet tells the
subscriber). Each is resynced the same way: the replica's entries dropped, then every batch the
new publisher buffered replayed from seq 0 (vLLM keeps 10,000 steps), never by joining live
traffic midway, which loses what the new engine stored before it. Without a replay endpoint
the live stream is joined where it is (the best there is).
"""

from __future__ import annotations

import logging
import time

from router.kv_events.apply import Applier
from router.kv_events.replay import Replay, Replayer
from router.kv_events.streams import Stream

log = logging.getLogger("prefix_router.kv_events")


class Position:
    def __init__(self, applier: Applier, replayer: Replayer, retry_s: float) -> None:
        self.applier = applier
        self.replayer = replayer
        self.retry_s = retry_s  # a failed check is tried again on live traffic after this

    async def live(self, stream: Stream, seq: int, payload: bytes) -> None:
        """One message from the SUB socket. The caller holds ``stream.lock``."""
        if stream.live_seq is not None and seq <= stream.live_seq:
            await self.resync(stream, f"publisher restarted (seq {seq} after {stream.live_seq})")
        stream.live_seq = seq
        if self._should_check(stream):
            await self.catch_up(stream)
        last = stream.last_applied
        if last is None:  # no replay found earlier batches: join here
            await self.applier.apply(stream, seq, payload)
            return
        if seq <= last:
            return  # applied from a replay
        if seq > last + 1:
            # A replay that just failed is not asked again at once (a hostile or broken
            # publisher's every message would cost one).
            retry = stream.replay_ok or time.monotonic() - stream.checked_at > self.retry_s
            answered = retry and await self.catch_up(stream)
            last = stream.last_applied
            if last is not None and seq <= last:
                return
            if answered and last is not None:
                # The publisher's buffer ends before this seq: not its message (one queued
                # from the process before a restart).
                self.applier.count(stream, "stale_message", 1)
                return
            await self.applier.reset(stream, f"batches after {last} lost, not replayable")
        await self.applier.apply(stream, seq, payload)

    def _should_check(self, stream: Stream) -> bool:
        if stream.verified or not stream.endpoints.replay:
            return False
        return time.monotonic() - stream.checked_at > self.retry_s

    async def catch_up(self, stream: Stream) -> bool:
        """Replay what followed the last batch applied, checking that the publisher is the
        one that sent it (a new one is resynced). True when the replay socket answered (the
        publisher is alive: silence is not loss). The caller holds ``stream.lock``."""
        stream.checked_at = time.monotonic()
        result = await self.replayer.replay(stream)
        if result is Replay.OTHER_PUBLISHER:
            await self.resync(stream, "a new publisher (the replay does not hold our last batch)")
            return True
        if result is Replay.HOLE:
            await self.applier.reset(stream, "batches lost beyond the replay buffer")
            stream.last_applied = stream.last_crc = None
            result = await self.replayer.replay(stream)  # join at the buffer's oldest
        stream.replay_ok = result is not Replay.FAILED
        if not stream.replay_ok:
            return False
        stream.verified = True
        stream.doubt = False
        return True

    async def resync(self, stream: Stream, why: str) -> None:
        """A new publisher process: drop what the old one taught, replay the new one from its
        seq 0. The caller holds ``stream.lock``."""
        stream.restarts += 1
        await self.applier.reset(stream, why)
        stream.last_applied = stream.last_crc = stream.live_seq = None
        stream.verified = False
        stream.checked_at = time.monotonic()
        if await self.replayer.replay(stream) is not Replay.FAILED:
            stream.verified = True
            stream.doubt = False
