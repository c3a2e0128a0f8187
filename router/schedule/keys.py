"""Ring keys of a request: where on the consistent-hash ring it starts looking."""

from __future__ import annotations

import xxhash

from router.core.blocks import pack_tokens
from router.intake.routed_request import RoutedRequest


def routing_key(req: RoutedRequest) -> int:
    """Block 0's hash (salted, adapter-keyed), or for a prompt shorter than one block a hash
    of its tokens, so short prompts spread too."""
    if req.block_hashes:
        return req.block_hashes[0]
    return xxhash.xxh3_64_intdigest(pack_tokens(req.token_ids[:256]))


def tie_key(req: RoutedRequest, held_blocks: int) -> int:
    """The ring key of the first block past ``held_blocks`` (the last block if none is)."""
    if held_blocks and req.block_hashes:
        return req.block_hashes[min(held_blocks, len(req.block_hashes) - 1)]
    return routing_key(req)
