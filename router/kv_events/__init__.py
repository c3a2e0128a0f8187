"""Precise mode: keep the index exact per replica from vLLM's own KV cache events.

One ZMQ SUB socket per replica (``router.kv_events.wire`` decodes). A ``BlockStored`` names vLLM's
hashes, the parent's vLLM hash and the blocks' token ids; the gateway's hash of each block
is computed with ``router.core.blocks``' chain from the parent's *gateway* hash (kept per replica,
vLLM hash -> gateway hash), or from ``root_hash(salt, lora)`` for block 0, the salt read from
block 0's extra keys and the adapter from ``lora_name``: so salted and LoRA blocks stay apart
exactly as on the replica. Stored blocks are recorded, removed ones forgotten, and
``AllBlocksCleared`` drops the replica. A hash may be held by several physical blocks (two
requests computing the same prefix at once): each store counts, each removal uncounts, and the
block leaves the index when no holder is left. The GPU tier (``medium`` "GPU") of KV cache
group 0 makes the index; an offload tier's blocks (CPU, storage) are kept beside it and extend
a replica's match (``tiers``); a hybrid model's other groups are set aside (``holders``).

Who does what: ``streams`` (one replica's stream state), ``tiers`` (offload tiers),
``position`` (sequence, replay,
restarts), ``replay`` (the replay socket), ``apply`` (events -> index writes, resets,
rebuilds), ``checks`` and ``placements`` (the gateway's own records, checked against the
events), ``takeover`` and ``ownership`` (fleet mode), ``subscriber`` (sockets, liveness, and
the wiring), ``precise_index`` (the index the gateway routes with).

Sequence numbers: a live message past the next expected seq is a gap, caught up from the
replay socket (``[b"", start]`` to vLLM's ROUTER). A replay starts at the last batch applied
and compares its checksum, so a restarted publisher (seq from 0 again) is told apart even once
its seq has passed the old one; a reconnected socket is checked that way before anything live
is applied, as is a replica back from a health gap, and the live seq going backwards or the
replica's counters resetting are restarts too. A restart drops the replica's entries and
replays the new publisher from seq 0 (never joins live traffic midway). A gap the replay
cannot cover (buffer too short) resets the replica and joins at the oldest batch buffered;
without a replay endpoint, where the live stream is. A stale "held" entry sends prefixes to a
cold replica; a missing one only misses an affinity, so doubt resolves to forgetting.

How it combines with the approximate model: the gateway still records a prompt's blocks when
it places a request (events arrive only once the replica schedules it, and a second request
for the same prefix must follow the first meanwhile). The replica stores every full block of
the prompt, so the events that follow record the same hashes, and its evictions remove them.
What the events do not confirm (a request that failed, a tokenization the replica does not
share, a record that landed after the block's removal event) is retracted once the request's
outcome is known plus a short settle, at once for a request the replica refused (4xx), or
``timeout_s`` after the placement without an outcome (``checks``), sparing what the events
hold or another placement still waits for: the index is what the events say plus the
placements whose events are still due, bounded by the replica's size.

A batch's index writes go out after its events, consecutive removals as one ``forget``: vLLM
sends one ``BlockRemoved`` per evicted block, and a round trip each (Redis, in fleet mode)
left a busy replica's stream ~100 batches behind, the index holding what it had evicted. A
batch is decoded and applied a slice at a time, messages are capped in size, and junk is
counted per batch: a hostile publisher cannot hold the loop.

Liveness, per replica: up while the SUB socket is connected (ZMQ's socket monitor) and the
replica answers placements with events or its replay socket answers: a placement followed by
no event for ``timeout_s`` is asked about through the replay (an idle publisher sends nothing
when nothing happened; silence is not loss); with no answer the stream is marked down (a
wedged or misconfigured publisher). Down, the replica is routed on the approximate model,
which placements kept feeding all along, and its placements wait: once the stream is back,
they are checked and the replica's entry is rebuilt from the events' held set (the
approximate model's LRU trimmed it in its own order meanwhile).
``prefix_router_kv_events_up{replica}`` says which.

Fleet mode: every gateway follows every stream (its local view stays exact), one gateway per
stream writes it to the shared index (``ownership``: a Redis lease, a stamped seq, catch-up on
takeover).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from router.index.base import PrefixIndex
from router.kv_events.ownership import StreamLeases
from router.kv_events.placements import SettleOnOutcome
from router.kv_events.precise_index import PreciseIndex
from router.kv_events.streams import Endpoints, Stream, endpoints_from_config
from router.kv_events.subscriber import KVEventSubscriber

if TYPE_CHECKING:
    from router.config import Config
    from router.fleet.mode import FleetMode
    from router.fleet.replicas import Fleet

__all__ = [
    "Endpoints",
    "KVEventSubscriber",
    "PreciseIndex",
    "SettleOnOutcome",
    "Stream",
    "StreamLeases",
    "endpoints_from_config",
    "start_for",
]


async def start_for(
    config: Config,
    fleet: Fleet,
    index: PrefixIndex,
    block_size: Callable[[str], int],
    metrics: Any,
    fleet_mode: FleetMode | None,
    namespace: Callable[[str], str | None] | None = None,
) -> KVEventSubscriber:
    """The subscriber for a gateway's fleet and index per its config, started. The gateway
    routes with its ``index`` (a ``PreciseIndex`` over ``index``) from then on, and gives
    each request's outcome to ``SettleOnOutcome(sub.settle, sub.reject)``."""

    def endpoints(urls: Iterable[str]) -> dict[str, Endpoints]:
        return endpoints_from_config(
            urls,
            config.kv_events.kv_events_endpoints,
            config.kv_events.kv_events_port,
            config.kv_events.kv_events_replay_port,
        )

    leases = None
    if fleet_mode is not None and fleet_mode.sync is not None:
        sync = fleet_mode.sync
        leases = StreamLeases(
            fleet_mode.redis,
            sync.prefix,
            sync.gateway_id,
            lambda: sync.peers,
            interval_s=config.fleet.sync_interval_s,
        )
    sub = KVEventSubscriber(
        index,
        endpoints,
        lambda: list(fleet.replicas),
        block_size,
        topic=config.kv_events.kv_events_topic,
        timeout_s=config.kv_events.kv_events_timeout_s,
        metrics=metrics,
        leases=leases,
        namespace=namespace,
    )
    await sub.start()
    return sub
