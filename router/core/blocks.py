"""Chained block hashes over a prompt's full token blocks, with vLLM's identity rules.

vLLM reuses a cached prefix only as a run of full blocks from token 0, each block's hash
chained to its parent's, a per-request ``cache_salt`` folded into block 0 and a LoRA adapter
into every block. The router needs the same *decisions*, not vLLM's digests, so it uses a fast
64-bit XXH3 chain with the same boundaries and the same salt/adapter separation: two prompts
share block i here exactly when vLLM would let them share block i.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_ROOT = xxhash.xxh3_64_intdigest(b"prefix-router/none-hash")


def root_hash(
    cache_salt: str | None = None, lora: str | None = None, namespace: str | None = None
) -> int:
    """The parent of block 0. Salt and adapter live here, so every block of the chain is
    re-keyed by them (vLLM puts the salt in block 0's extra keys and the adapter in every
    block's; through the chain the effect on sharing is the same). ``namespace``: the served
    model (router/models/), so two models' chains never share a key in any index."""
    if cache_salt is None and lora is None and namespace is None:
        return _ROOT
    key = f"salt={cache_salt!r}\x00lora={lora!r}".encode()
    if namespace is not None:
        key += f"\x00model={namespace!r}".encode()
    return xxhash.xxh3_64_intdigest(key, seed=_ROOT)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, so block hashing is one pass over one buffer."""
    arr = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    return arr.tobytes()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora: str | None = None,
    max_blocks: int | None = None,
    namespace: str | None = None,
) -> list[int]:
    """Hashes of the leading full blocks of ``token_ids`` (a partial last block is never cached
    by vLLM, so it is never hashed). At most ``max_blocks`` are computed."""
    n = _full_blocks(token_ids, block_size, max_blocks)
    out: list[int] = []
    if n:
        step = 4 * block_size
        parent = root_hash(cache_salt, lora, namespace)
        _chain(pack_tokens(token_ids), 0, n * step, step, parent, out)
    return out


def continue_chain(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` chained onto ``parent`` (a block hash, or
    ``root_hash(...)`` for block 0): what ``block_hashes`` gives for a prompt's later blocks,
    from the tokens of those blocks alone (how vLLM's KV events describe stored blocks)."""
    n = _full_blocks(token_ids, block_size, None)
    out: list[int] = []
    if n:
        step = 4 * block_size
        _chain(pack_tokens(token_ids), 0, n * step, step, parent, out)
    return out


def _full_blocks(token_ids: Sequence[int], block_size: int, max_blocks: int | None) -> int:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    return n if max_blocks is None else min(n, max_blocks)


@functools.lru_cache(maxsize=16)
def _blocks_of(step: int) -> struct.Struct:
    return struct.Struct(f"{step}s")


def _chain(
    buf: bytes | memoryview, start: int, end: int, step: int, parent: int, out: list[int]
) -> int:
    """Append the chained hashes of the ``step``-byte blocks of ``buf[start:end]`` to ``out``;
    returns the last one (the parent of what follows)."""
    digest = xxhash.xxh3_64_intdigest
    append = out.append
    # struct cuts the blocks in C (a fifth of the cost of slicing them in the loop); a
    # positional seed is half the cost of seed=.
    for (block,) in _blocks_of(step).iter_unpack(memoryview(buf)[start:end]):
        parent = digest(block, parent)
        append(parent)
    return parent


class ChainCache:
    """``block_hashes`` with a memo of whole runs of blocks, for the gateway's hot path.

    A shared system prompt yields the same leading blocks on every request; hashing them one
    call per block is the bulk of hashing's cost. Blocks are taken ``GROUP`` at a time: each
    group is keyed by a 128-bit hash of its bytes seeded with the previous group's key (the
    first with the salt and adapter's root), so a hit means the same token prefix, as surely
    as the 64-bit block chain itself can tell; it returns the group's block hashes at once.
    Bounded LRU (4,096 groups, ~5 MB, 2M tokens of prefixes); the results are exactly
    ``block_hashes``'s (tests check it)."""

    GROUP = 32

    def __init__(self, max_groups: int = 4_096) -> None:
        self.max_groups = max_groups
        self._groups: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        max_blocks: int | None = None,
        namespace: str | None = None,
        known: Sequence[int] | None = None,
    ) -> list[int]:
        """``known``: the hashes of the leading blocks, already computed for the same root
        and block size (a prefix state's, router/prompt/prefix_state.py): only the blocks
        after them are hashed."""
        n = _full_blocks(token_ids, block_size, max_blocks)
        if n == 0:
            return []
        step = 4 * block_size
        if known:
            have = list(known[:n])
            if len(have) < n:
                # An array's own buffer: only the blocks after the known ones are read (a
                # tobytes copy of the whole prompt cost more than hashing the new blocks).
                view = (
                    memoryview(token_ids).cast("B")
                    if isinstance(token_ids, array)
                    else pack_tokens(token_ids)
                )
                _chain(view, len(have) * step, n * step, step, have[-1], have)
            return have
        buf = pack_tokens(token_ids)
        parent = root_hash(cache_salt, lora, namespace)
        seed = parent ^ step  # the block size is part of the identity
        out: list[int] = []
        groups = self._groups
        group_bytes = self.GROUP * step
        full = n // self.GROUP * group_bytes
        for start in range(0, full, group_bytes):
            chunk = buf[start : start + group_bytes]
            k = xxhash.xxh3_128_intdigest(chunk, seed)
            seed = k & 0xFFFFFFFFFFFFFFFF
            hit = groups.get(k)
            if hit is not None:
                groups.move_to_end(k)
                out.extend(hit)
                parent = hit[-1]
                continue
            first = len(out)
            parent = _chain(buf, start, start + group_bytes, step, parent, out)
            groups[k] = tuple(out[first:])
            if len(groups) > self.max_groups:
                groups.popitem(last=False)
        _chain(buf, full, n * step, step, parent, out)
        return out


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks vLLM can serve from cache: the hit is capped at
    ``num_tokens - 1`` because the last prompt token must be computed for its logits."""
    return max(0, (num_tokens - 1) // block_size)
