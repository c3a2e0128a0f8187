"""Decoding vLLM's KV cache event messages (``vllm/distributed/kv_events.py``), defensively.

A message is multipart ``(topic, seq as 8-byte big-endian, payload)``; the payload is msgpack
``[ts, events, data_parallel_rank]`` and each event a map tagged ``"type"`` (vLLM >= 0.10;
older releases sent events as arrays ``[type, field, ...]`` in field order: both are read).
Hashes are vLLM's ``ExternalBlockHash``: an unsigned 64-bit int by default, the digest's bytes
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

Everything from the wire is untrusted: a malformed message raises ``WireError`` (with a short
``reason`` for metrics), a malformed or unknown event becomes ``Skipped``; nothing else escapes.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

Hash = int | bytes

MAX_HASH_BYTES = 64
MAX_TOKEN_ID = 2**32 - 1  # router.core.blocks packs token ids as uint32
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_STORED_TAIL = ("medium", "lora_name", "extra_keys", "group_idx")
MEDIUM_GPU = "GPU"


class WireError(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int  # 0: an offload tier's placeholder (hashes only, no tokens)
    lora_name: str | None
    extra_keys: list[Any] | None
    medium: str | None = MEDIUM_GPU  # "GPU", or an offload tier ("CPU", "STORAGE"); None: GPU
    group_idx: int | None = None  # the KV cache group (hybrid models have several)

    def cache_salt(self) -> str | None:
        """The ``cache_salt`` of block 0, when this event starts a chain. vLLM publishes each
        block's extra keys untagged, in order: the LoRA name, ``(mm_id, offset)`` pairs, the
        salt (block 0 only), prompt-embeds digests (bytes); so the salt is the first string
        after the LoRA name."""
        if self.parent_block_hash is not None or not self.extra_keys:
            return None
        keys = self.extra_keys[0]
        if not isinstance(keys, list):
            return None
        if self.lora_name is not None and keys and keys[0] == self.lora_name:
            keys = keys[1:]
        return next((k for k in keys if isinstance(k, str)), None)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[Hash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class Skipped:
    """An event that was not applied: ``reason`` is ``unknown_type`` or ``malformed``."""

    reason: str
    detail: str = ""


Event = BlockStored | BlockRemoved | AllBlocksCleared | Skipped


def parse_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a PUB message (``topic, seq, payload``) or of a replay reply
    with its topic (vLLM 0.34) or without it (older). seq is -1 for the replay end marker."""
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2:
        raise WireError("frames", f"{len(frames)} frames")
    seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise WireError("frames", f"sequence frame of {len(seq_bytes)} bytes")
    return int.from_bytes(seq_bytes, "big", signed=True), payload


def decode_batch(payload: bytes, max_items: int = 4_000_000) -> list[Event]:
    """The events of one payload, in order. Raises ``WireError`` when the payload is not an
    event batch at all."""
    return list(iter_events(payload, max_items))


def digest(payload: bytes) -> int:
    """A batch's identity for telling publishers apart: a checksum of its head (which holds
    the publisher's timestamp) and tail, and its length; constant time on a huge message."""
    if len(payload) <= 8192:
        return zlib.crc32(payload)
    return zlib.crc32(payload[-4096:], zlib.crc32(payload[:4096])) ^ len(payload)


MAX_EVENTS = 65_536  # per batch: a vLLM step's (one store per request, one removal per
# evicted block: a few thousand at most); more is a hostile publisher's, refused unread


def iter_events(
    payload: bytes, max_items: int = 4_000_000, max_events: int = MAX_EVENTS
) -> Iterator[Event]:
    """The events of one payload, decoded one at a time (a caller can yield to its loop
    between them: a 40 MB batch decoded at once held the loop for 0.7 s). Raises
    ``WireError`` (possibly after some events) when the payload is not an event batch."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        max_buffer_size=max(1, len(payload)),
        max_array_len=max_items,
        max_map_len=1024,
        max_str_len=1 << 20,
        max_bin_len=1 << 20,
        max_ext_len=0,
    )
    try:
        unpacker.feed(payload)
        if unpacker.read_array_header() < 2:
            raise WireError("batch", "not [ts, events, ...]")
        unpacker.skip()  # ts
        n = unpacker.read_array_header()
    except WireError:
        raise
    except Exception as e:  # msgpack raises several types (and ValueError on limits)
        raise WireError(_shape_or_bytes(payload), type(e).__name__) from None
    if n > max_events:
        raise WireError("too_many_events", str(n))
    for _ in range(n):
        try:
            raw = unpacker.unpack()
        except Exception as e:
            raise WireError("msgpack", type(e).__name__) from None
        yield _event(raw)


def _shape_or_bytes(payload: bytes) -> str:
    """Why a payload is not a batch: ``batch`` when it is one msgpack object of another
    shape, ``msgpack`` when it is not msgpack at all."""
    try:
        msgpack.unpackb(payload, strict_map_key=False, max_ext_len=0)
    except Exception:
        return "msgpack"
    return "batch"


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {
            "BlockStored": _STORED_FIELDS + _STORED_TAIL,
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        return Skipped("malformed", "event is neither a map nor a tagged array")
    try:
        if kind == "BlockStored":
            return _stored(fields)
        if kind == "BlockRemoved":
            return BlockRemoved(
                _hashes(fields.get("block_hashes")),
                _medium(fields.get("medium")),
                _group(fields.get("group_idx")),
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except WireError as e:
        return Skipped("malformed", str(e))
    return Skipped("unknown_type", str(kind)[:64])


def _hash(value: Any) -> Hash:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise WireError("hash", "not a uint64 or digest bytes")


def _hashes(value: Any) -> list[Hash]:
    if not isinstance(value, list) or not value:
        raise WireError("block_hashes", "not a non-empty list")
    return [_hash(v) for v in value]


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    parent = None if parent is None else _hash(parent)
    medium = _medium(f.get("medium", MEDIUM_GPU))
    size = f.get("block_size")
    tokens = f.get("token_ids")
    if medium not in (None, MEDIUM_GPU) and size == 0 and tokens == []:
        # vLLM's offloading connector without ``self_describing_kv_events`` (the default):
        # a placeholder naming the offloaded chunk's last hash only (offloading/events.py,
        # ``_placeholder_stored``: no parent, no tokens, block_size 0).
        size = 0
    elif not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= 1 << 16:
        raise WireError("block_size", repr(size)[:32])
    elif not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        raise WireError("token_ids", "not one block of tokens per hash")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            raise WireError("token_ids", "not uint32 token ids")
    lora = f.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise WireError("lora_name", "not a string")
    extra = f.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise WireError("extra_keys", "not one entry per block")
    return BlockStored(
        hashes,
        parent,
        tokens,
        size,
        lora,
        extra,
        medium,
        _group(f.get("group_idx")),
    )


def _medium(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= 64):
        return value
    raise WireError("medium", "not a string")


def _group(value: Any) -> int | None:
    if value is None or (type(value) is int and 0 <= value < 1 << 16):
        return value
    raise WireError("group_idx", "not a small int")
