"""What one replica's events say its GPU holds: vLLM hash -> gateway hash, with the number of
physical blocks holding each (two requests computing the same prefix at once both store it).

Only the GPU tier of the primary KV cache group counts here: an offload tier (``medium``
"CPU", ...) publishes its own stores and removals (kept in ``router.kv_events.tiers``), and a
hybrid model's other groups (``group_idx``) theirs; a removal there must not uncount a GPU
block. Pure bookkeeping: no I/O, no awaits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from router.kv_events.wire import MEDIUM_GPU, Hash

MEMO_ENTRIES = 65_536  # vLLM -> gateway hashes of recently removed blocks (see ``parent``)
PRIMARY_GROUP = 0


def counts(medium: str | None, group_idx: int | None) -> bool:
    """Whether an event of this tier and group changes what the GPU holds for routing."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, PRIMARY_GROUP)


class Holders:
    __slots__ = ("held", "gw", "memo")

    def __init__(self) -> None:
        self.held: dict[Hash, list[int]] = {}  # vLLM hash -> [gateway hash, holders]
        # gateway hash -> holders, in the order first stored (a rebuild records them so)
        self.gw: dict[int, int] = {}
        self.memo: OrderedDict[Hash, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.gw)

    def __contains__(self, gateway_hash: int) -> bool:
        return gateway_hash in self.gw

    def __iter__(self) -> Iterator[int]:
        return iter(self.gw)

    def parent(self, vh: Hash) -> int | None:
        """The gateway hash of a stored block, or of one no longer counted (a reset, a
        removal that raced a store): the mapping is a function of the chain."""
        entry = self.held.get(vh)
        return entry[0] if entry is not None else self.memo.get(vh)

    def store(self, vhashes: Sequence[Hash], gws: Sequence[int]) -> None:
        held, gw = self.held, self.gw
        for vh, gh in zip(vhashes, gws, strict=True):
            entry = held.get(vh)
            if entry is None:
                held[vh] = [gh, 1]
                gw[gh] = gw.get(gh, 0) + 1
            else:
                entry[1] += 1

    def remove(self, vhashes: Iterable[Hash]) -> list[int]:
        """Uncount one holder of each; the gateway hashes no block holds any more."""
        held, gw, memo = self.held, self.gw, self.memo
        gone = []
        for vh in vhashes:
            entry = held.get(vh)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] > 0:
                continue
            del held[vh]
            gh = entry[0]
            memo[vh] = gh
            n = gw.get(gh, 0) - 1
            if n > 0:
                gw[gh] = n
            else:
                gw.pop(gh, None)
                gone.append(gh)
        self._trim_memo()
        return gone

    def clear(self) -> None:
        """Forget every holder (a reset); the chain mapping stays in the memo."""
        memo = self.memo
        for vh, (gh, _) in self.held.items():
            memo[vh] = gh
        self._trim_memo()
        self.held.clear()
        self.gw.clear()

    def _trim_memo(self) -> None:
        memo = self.memo
        while len(memo) > MEMO_ENTRIES:
            memo.popitem(last=False)
