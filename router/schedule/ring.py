"""Consistent hashing with bounded loads (Mirrokni et al.; KubeAI's CHWBL).

A cold prefix goes to the replica its first block hashes to, walking clockwise past any replica
whose load would exceed ``c x`` the mean. Every gateway that sees the same members builds the
same ring, so a cold prefix lands on the same replica whichever gateway it reaches, and adding
a replica moves only its share of prefixes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import xxhash

# Requests a replica may have above ``c x mean`` before the bound applies. At a handful of
# requests in flight, ceil(1.25 x mean) is 2 or 3: a bound that tight overrides the cost model
# on noise (a replica busy decoding looks "full") and costs TTFT; the slack keeps the bound for
# real hot spots, where it still caps a replica near c x mean.
LOAD_SLACK = 2


def load_bound(c: float, loads: Sequence[float]) -> int:
    """The most requests any replica may hold after taking one more: ceil(c x mean) + slack."""
    return math.ceil(c * (sum(loads) + 1) / len(loads)) + LOAD_SLACK


# Ring orders memoised per key (a prefix's block 0: a tenant's system prompt) while the
# members stay; the memo is emptied when it holds this many.
ORDER_MEMO = 4096


class HashRing:
    def __init__(self, members: Iterable[str] = (), virtual_nodes: int = 160) -> None:
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._orders: dict[int, tuple[str, ...]] = {}
        self.members: tuple[str, ...] = ()
        self.set_members(members)

    def set_members(self, members: Iterable[str]) -> None:
        members = tuple(sorted(set(members)))
        if members == self.members:
            return
        points = []
        for m in members:
            for v in range(self.virtual_nodes):
                points.append((xxhash.xxh3_64_intdigest(f"{m}#{v}".encode()), m))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]
        self._orders = {}
        self.members = members

    def of(self, model: str | None) -> HashRing:
        """One ring for every model (``Rings`` keeps one per model)."""
        return self

    def order(self, key: int) -> tuple[str, ...]:
        """``tuple(walk(key))``, memoised per key until the members change."""
        orders = self._orders
        found = orders.get(key)
        if found is None:
            if len(orders) >= ORDER_MEMO:
                orders.clear()
            found = orders[key] = tuple(self.walk(key))
        return found

    def walk(self, key: int) -> Iterator[str]:
        """Distinct members in ring order starting at ``key``'s position."""
        n = len(self._points)
        if n == 0:
            return
        start = bisect.bisect_left(self._points, key & 0xFFFFFFFFFFFFFFFF) % n
        seen: set[str] = set()
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.members):
                    return

    def rank(self, key: int) -> dict[str, int]:
        """Each member's position in ``walk(key)``: a per-key, fleet-wide tie-break order."""
        return {m: i for i, m in enumerate(self.walk(key))}

    def pick(
        self, key: int, load: Callable[[str], float], allowed: Iterable[str], c: float
    ) -> str | None:
        """The first member in ring order (among ``allowed``) whose load after taking this
        request stays within ``load_bound``; the least loaded one if none does."""
        allowed = set(allowed)
        if not allowed:
            return None
        bound = load_bound(c, [load(m) for m in allowed])
        order = [m for m in self.walk(key) if m in allowed]
        order += sorted(allowed - set(order))  # members not on the ring yet
        for m in order:
            if load(m) + 1 <= bound:
                return m
        return min(order, key=load)


class RingSource(Protocol):
    """What the scheduler asks for a request's ring: ``HashRing`` (one for all) or ``Rings``."""

    @property
    def members(self) -> tuple[str, ...]: ...

    def of(self, model: str | None) -> HashRing: ...


class Rings:
    """One ring per served model, over the members that serve it, plus the fleet's ring for a
    model no replica has reported (yet). A replica's points depend on its URL alone, so model
    M's ring is the same on every gateway that sees the same members serving M, whatever
    other models it has seen, and a walk visits only M's replicas."""

    def __init__(self, virtual_nodes: int = 160) -> None:
        self.virtual_nodes = virtual_nodes
        self._all = HashRing(virtual_nodes=virtual_nodes)
        self._rings: dict[str, HashRing] = {}

    @property
    def members(self) -> tuple[str, ...]:
        return self._all.members

    def set_members(
        self, members: Iterable[str], groups: Mapping[str, Iterable[str]] | None = None
    ) -> None:
        """``members``: the fleet's ring members; ``groups``: model -> the replicas that
        report serving it (its ring holds those among ``members``)."""
        self._all.set_members(members)
        groups = groups or {}
        for model in [m for m in self._rings if m not in groups]:
            del self._rings[model]
        held = set(self._all.members)
        for model, urls in groups.items():
            ring = self._rings.get(model)
            if ring is None:
                ring = self._rings[model] = HashRing(virtual_nodes=self.virtual_nodes)
            ring.set_members(held.intersection(urls))

    def of(self, model: str | None) -> HashRing:
        return self._rings.get(model, self._all) if model else self._all

    def models(self) -> dict[str, tuple[str, ...]]:
        """model -> its ring's members (for /ready and the tests)."""
        return {m: r.members for m, r in sorted(self._rings.items())}
