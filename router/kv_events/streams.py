"""One replica's KV event stream: where its publisher is, where in its sequence we are, and
what its events taught."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from router.kv_events.holders import Holders
from router.kv_events.placements import Placements
from router.kv_events.tiers import Tiers

OPLOG_BATCHES = 4096  # a takeover further behind than this resyncs instead

# One index write an event caused: ("record" | "forget", hashes) or ("drop", []) or
# ("capacity", [blocks]).
Op = tuple[str, list[int]]


@dataclass
class Endpoints:
    pub: str
    replay: str | None = None


def endpoints_from_config(
    urls: Iterable[str],
    explicit: Mapping[str, Any],
    port: int,
    replay_port: int | None,
) -> dict[str, Endpoints]:
    """Each replica's publisher: ``explicit[url]`` (an endpoint string, or a mapping with
    ``endpoint`` and optional ``replay_endpoint``), else the replica's host with ``port``."""
    out = {}
    for url in urls:
        given = explicit.get(url)
        if isinstance(given, str):
            out[url] = Endpoints(given)
        elif isinstance(given, Mapping):
            out[url] = Endpoints(str(given["endpoint"]), given.get("replay_endpoint"))
        else:
            host = urlsplit(url).hostname or "127.0.0.1"
            shown = f"[{host}]" if ":" in host else host
            replay = f"tcp://{shown}:{replay_port}" if replay_port else None
            out[url] = Endpoints(f"tcp://{shown}:{port}", replay)
    return out


@dataclass
class Stream:
    """One replica's event stream: its sockets, its position in the publisher's sequence,
    what its events taught (``holders``) and the placements they have yet to confirm."""

    url: str
    endpoints: Endpoints
    sub: zmq.asyncio.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None  # its socket monitor (connects, disconnects)
    monitor_sync: zmq.Socket[bytes] | None = None  # the same, read without waiting
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one applier at a time, in order
    connected: bool = False
    disconnects: int = 0
    disconnected_since: float | None = None
    up: bool = False
    # Position: the seq and payload checksum of the last batch applied, and whether that is
    # known to be the current publisher's (false after a disconnect or a restart until the
    # replay socket confirms it, or a resync from seq 0 replaces it).
    last_applied: int | None = None
    last_crc: int | None = None
    verified: bool = False
    # Something suggested another publisher (a disconnect, a health gap): until a replay shows
    # our last batch, a replay that cannot (its buffer starts after it) is not trusted.
    doubt: bool = False
    checked_at: float = float("-inf")  # when the replay last checked the position
    replay_ok: bool = True  # whether that replay answered
    live_seq: int | None = None  # seq of the last message on the SUB socket
    expect_since: float | None = None  # a placement not followed by any event yet
    holders: Holders = field(default_factory=Holders)
    tiers: Tiers = field(default_factory=Tiers)  # offload tiers' copies (CPU, storage)
    capacity: int | None = None
    # The index may differ from ``holders`` (trimmed by the approximate model's LRU while
    # the stream was down): rebuilt from them once the stream is up again.
    rebuild: bool = False
    # The gateway's placements on this replica whose blocks the events have yet to confirm.
    placements: Placements = field(default_factory=Placements)
    batches: int = 0
    resets: int = 0
    restarts: int = 0  # new publisher processes noticed (each resynced from its seq 0)
    rebuilds: int = 0
    replays: int = 0
    other_tier_blocks: int = 0  # blocks stored in another KV cache group (hybrid models)
    errors: dict[str, int] = field(default_factory=dict)
    # Fleet mode (router/kv_events/ownership.py): whether this gateway writes the stream's
    # events to the shared index, who holds its lease, the stamp of the last batch applied
    # ("<seq>:<crc>"), and each recent batch's index writes, for a takeover's catch-up.
    owned: bool = True
    applying: bool = False  # inside a batch: its writes join its log entry
    holder: str = ""
    written: str = ""
    oplog: deque[tuple[str, list[Op]]] = field(default_factory=lambda: deque(maxlen=OPLOG_BATCHES))
    shared_batches: int = 0  # batches whose writes went to the shared index
    takeovers: int = 0
    caught_up: int = 0  # batches replayed into the shared index on takeovers
    resyncs: int = 0  # takeovers that rewrote the replica's shared entry instead

    @property
    def gw_holders(self) -> Holders:
        """The gateway hashes the events say are held (``in``, ``len``, iteration)."""
        return self.holders

    def state(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "connected": self.connected,
            "seq": self.last_applied,
            "blocks": len(self.holders),
            "offloaded_blocks": self.tiers.sizes(),
            "resets": self.resets,
            "restarts": self.restarts,
            "unconfirmed_placements": len(self.placements),
            "retracted_blocks": self.placements.retracted,
            "replays": self.replays,
            "owned": self.owned,
            "owner": self.holder or None,
        }
