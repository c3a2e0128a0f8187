"""Shared budgets with fair shares: what all clients together may hold at once, and the share
of it any one client may hold, so one client (a tenant, or a peer address when no key says
who is calling) cannot exhaust what every other client needs.

Used for request-body bytes being received (router/http/handlers.py) and client connections
(router/http/connections.py)."""

from __future__ import annotations

import ipaddress
import math


class SharedBudget:
    """``total`` units at most held at once, at most ``share`` of them by one client."""

    def __init__(self, total: int, share: int) -> None:
        self.total = total
        self.share = min(share, total)
        self.held = 0
        self._by: dict[str, int] = {}

    def held_by(self, client: str) -> int:
        return self._by.get(client, 0)

    def clients(self) -> int:
        """How many clients hold something now."""
        return len(self._by)

    def fits(self, client: str, n: int) -> str | None:
        """None if ``client`` may take ``n`` more, else which bound it would break:
        ``"total"`` or ``"share"``."""
        if self._by.get(client, 0) + n > self.share:
            return "share"
        if self.held + n > self.total:
            return "total"
        return None

    def take(self, client: str, n: int) -> str | None:
        """Take ``n`` for ``client`` if it fits (then None), else take nothing and say which
        bound it would break (``fits``)."""
        refused = self.fits(client, n)
        if refused is None:
            self.held += n
            self._by[client] = self._by.get(client, 0) + n
        return refused

    def give_back(self, client: str, n: int) -> None:
        if n <= 0:
            return
        self.held -= n
        left = self._by.get(client, 0) - n
        if left > 0:
            self._by[client] = left
        else:
            self._by.pop(client, None)  # the map holds only clients holding something


def share_of(total: int, fraction: float, at_least: int = 1) -> int:
    """A client's share of ``total``: ``fraction`` of it, never below ``at_least``."""
    return max(at_least, math.ceil(total * fraction))


def peer_key(remote: str | None) -> str:
    """The client a peer address stands for: the IPv4 address, or the IPv6 /64 (one host
    commonly holds a whole /64, so its addresses are one client); an IPv4-mapped IPv6
    address is its IPv4 address."""
    if not remote:
        return "peer:unknown"
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return f"peer:{remote[:64]}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"peer:{ip.ipv4_mapped}"
        return f"peer:{ipaddress.IPv6Network((ip, 64), strict=False)}"
    return f"peer:{ip}"


def in_networks(remote: str | None, networks: list[str]) -> bool:
    """Whether the peer address ``remote`` is in one of ``networks`` (CIDR strings; an
    IPv4-mapped IPv6 peer counts as its IPv4 address)."""
    if not remote or not networks:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for net in networks:
        try:
            if ip in ipaddress.ip_network(net, strict=False):
                return True
        except ValueError:
            continue
    return False
