"""Replica discovery by DNS: resolve a name (a Kubernetes headless Service, a Consul name, a
round-robin record) to its A/AAAA records every ``interval_s`` and hand the fleet the replica
URLs ``http://IP:PORT`` whenever the set changes.

Two resolvers are provided:

- :func:`system_resolver` uses ``loop.getaddrinfo`` (the libc resolver: ``/etc/hosts``,
  ``resolv.conf`` search domains, nscd). The default.
- :func:`udp_resolver` is a minimal DNS client that asks one given nameserver directly over
  UDP (EDNS0, 4096-byte payload), falling back to TCP when the answer is truncated. It sees
  exactly what that server answers (no search list, no caching), which is what a test or a
  deployment pointing at a specific server wants.

Failure policy: a lookup that fails (timeout, SERVFAIL, refused, malformed) keeps the last
good set; so does, by default, a lookup that finds no address (NXDOMAIN/NODATA), because a
headless Service with no ready pods answers NXDOMAIN, and a transient empty answer must not
unload the whole fleet (health checks take dead replicas out of rotation anyway). Set
``allow_empty=True`` to propagate an empty set. A failure streak is logged once, at its start,
and its end is logged once too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.core.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``async (host, port) -> [ip, ...]``; raises :class:`DnsError` (or ``OSError``) on failure
and returns ``[]`` when the name exists but has no address (or does not exist)."""

OnChange = Callable[[list[str]], Awaitable[None]]

QTYPE_A = 1
QTYPE_AAAA = 28
_QTYPE_OPT = 41
_CLASS_IN = 1
_RCODE_NXDOMAIN = 3
_EDNS_PAYLOAD = 4096


class DnsError(Exception):
    """A lookup failed (as opposed to finding no address)."""


# ---------------------------------------------------------------------------- URLs


def replica_url(ip: str, port: int, scheme: str = "http") -> str:
    """``http://10.0.0.1:8000``, ``http://[fd00::1]:8000`` (IPv6 bracketed, zone kept as %25)."""
    addr, _, zone = ip.partition("%")
    parsed = ipaddress.ip_address(addr)
    if parsed.version == 6:
        host = f"[{parsed.compressed}%25{zone}]" if zone else f"[{parsed.compressed}]"
    else:
        host = str(parsed)
    return f"{scheme}://{host}:{port}"


def replica_urls(ips: Iterable[str], port: int, scheme: str = "http") -> list[str]:
    """Sorted, de-duplicated URLs for ``ips``."""
    return sorted({replica_url(ip, port, scheme) for ip in ips})


# ---------------------------------------------------------------------------- resolvers


async def system_resolver(host: str, port: int) -> list[str]:
    """A and AAAA addresses of ``host`` from the system resolver (``getaddrinfo``)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        no_name = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}
        if exc.errno in no_name:
            return []
        raise DnsError(f"getaddrinfo({host!r}) failed: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


def parse_nameserver(spec: str, default_port: int = 53) -> tuple[str, int]:
    """``"10.96.0.10"``, ``"10.96.0.10:53"``, ``"[fd00::a]:53"`` or ``"fd00::a"`` → (host, port)."""
    spec = spec.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if spec.count(":") == 1:
        host, _, port = spec.partition(":")
        return host, int(port)
    return spec, default_port


def encode_query(name: str, qtype: int, qid: int) -> bytes:
    """A recursive query for ``name``/``qtype`` with an EDNS0 OPT record (4096-byte payload)."""
    header = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 1)  # RD; 1 question, 1 additional
    opt = b"\x00" + struct.pack("!HHIH", _QTYPE_OPT, _EDNS_PAYLOAD, 0, 0)
    return header + encode_name(name) + struct.pack("!HH", qtype, _CLASS_IN) + opt


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("idna")
        if not 0 < len(raw) <= 63:
            raise ValueError(f"bad DNS name {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\x00"


def _skip_name(msg: bytes, off: int) -> int:
    while True:
        if off >= len(msg):
            raise DnsError("truncated name")
        length = msg[off]
        if length & 0xC0 == 0xC0:  # compression pointer: 2 bytes, ends the name
            return off + 2
        if length == 0:
            return off + 1
        off += 1 + length


@dataclass(frozen=True)
class DnsAnswer:
    rcode: int
    truncated: bool
    addresses: list[str]


def decode_response(msg: bytes, qid: int, qtype: int) -> DnsAnswer:
    """The addresses of type ``qtype`` in the answer section of ``msg``."""
    if len(msg) < 12:
        raise DnsError("short DNS message")
    rid, flags, qdcount, ancount, _, _ = struct.unpack_from("!HHHHHH", msg)
    if rid != qid or not flags & 0x8000:
        raise DnsError("not a response to our query")
    off = 12
    for _ in range(qdcount):
        off = _skip_name(msg, off) + 4
    addresses: list[str] = []
    for _ in range(ancount):
        off = _skip_name(msg, off)
        if off + 10 > len(msg):
            raise DnsError("truncated record")
        rtype, rclass, _ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        off += 10
        rdata = msg[off : off + rdlen]
        off += rdlen
        if len(rdata) != rdlen:
            raise DnsError("truncated rdata")
        if rclass != _CLASS_IN or rtype != qtype:
            continue  # CNAMEs and the like: the resolver also sends the target's addresses
        if rtype == QTYPE_A and rdlen == 4:
            addresses.append(socket.inet_ntop(socket.AF_INET, rdata))
        elif rtype == QTYPE_AAAA and rdlen == 16:
            addresses.append(socket.inet_ntop(socket.AF_INET6, rdata))
    return DnsAnswer(rcode=flags & 0x000F, truncated=bool(flags & 0x0200), addresses=addresses)


class _UdpQuery(asyncio.DatagramProtocol):
    def __init__(self, qid: int) -> None:
        self.qid = qid
        self.reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if (
            len(data) >= 2
            and struct.unpack_from("!H", data)[0] == self.qid
            and not self.reply.done()
        ):
            self.reply.set_result(data)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable
        if not self.reply.done():
            self.reply.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc or ConnectionError("socket closed"))


async def _query_udp(server: tuple[str, int], packet: bytes, qid: int, timeout: float) -> bytes:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        lambda: _UdpQuery(qid), remote_addr=server
    )
    try:
        transport.sendto(packet)
        return await asyncio.wait_for(proto.reply, timeout)
    finally:
        if not proto.reply.done():
            proto.reply.cancel()  # before close(), so connection_lost() finds it settled
        transport.close()


async def _query_tcp(server: tuple[str, int], packet: bytes, timeout: float) -> bytes:
    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection(server[0], server[1])
        try:
            writer.write(struct.pack("!H", len(packet)) + packet)
            await writer.drain()
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            return await reader.readexactly(length)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.wait_for(exchange(), timeout)


async def query(
    server: tuple[str, int], name: str, qtype: int, *, timeout: float = 2.0, attempts: int = 2
) -> list[str]:
    """Addresses of ``name`` of type ``qtype`` (A or AAAA) as answered by ``server``.

    UDP first (retried ``attempts`` times on timeout), TCP when the UDP answer is truncated.
    NXDOMAIN and NODATA give ``[]``; any other error rcode, a timeout or a socket error raises
    :class:`DnsError`.
    """
    last: BaseException | None = None
    for _ in range(max(1, attempts)):
        qid = secrets.randbits(16)
        packet = encode_query(name, qtype, qid)
        try:
            answer = decode_response(await _query_udp(server, packet, qid, timeout), qid, qtype)
            if answer.truncated:
                answer = decode_response(await _query_tcp(server, packet, timeout), qid, qtype)
        except (asyncio.TimeoutError, OSError, EOFError, DnsError) as exc:
            last = exc
            continue
        if answer.rcode == _RCODE_NXDOMAIN:
            return []
        if answer.rcode != 0:
            raise DnsError(f"{name}: DNS rcode {answer.rcode} from {server[0]}:{server[1]}")
        return answer.addresses
    raise DnsError(f"{name}: no answer from {server[0]}:{server[1]}: {last!r}") from last


def udp_resolver(
    nameserver: tuple[str, int],
    *,
    timeout: float = 2.0,
    attempts: int = 2,
    families: Iterable[int] = (QTYPE_A, QTYPE_AAAA),
) -> Resolver:
    """A :data:`Resolver` that asks ``nameserver`` directly for A and AAAA records.

    Fails (raises) only when every record type failed; a name with only A records is fine.
    """
    qtypes = tuple(families)

    async def resolve(host: str, port: int) -> list[str]:
        results = await asyncio.gather(
            *(query(nameserver, host, qt, timeout=timeout, attempts=attempts) for qt in qtypes),
            return_exceptions=True,
        )
        addresses: set[str] = set()
        errors: list[BaseException] = []
        for res in results:
            if isinstance(res, BaseException):
                errors.append(res)
            else:
                addresses.update(res)
        if errors and len(errors) == len(results):
            raise DnsError(str(errors[0])) from errors[0]
        return sorted(addresses)

    return resolve


# ---------------------------------------------------------------------------- discovery


_FIELDS = ("dns", "port", "interval_s", "scheme", "nameserver", "timeout_s", "allow_empty")


@dataclass(frozen=True)
class DnsDiscoveryConfig:
    """Settings of DNS discovery. In the gateway config they are the flat ``discovery_*``
    keys (flags ``--discovery-dns`` ..., env ``PREFIX_ROUTER_DISCOVERY_DNS`` ...)::

        discovery_dns: vllm-headless.default.svc.cluster.local   # name to resolve
        discovery_port: 8000                                      # replica port
        discovery_interval_s: 10                                  # re-resolve period

    and, where the config defines them, ``discovery_scheme``, ``discovery_nameserver``
    (``"10.96.0.10:53"``: ask that server directly), ``discovery_timeout_s`` and
    ``discovery_allow_empty``.
    """

    dns: str
    port: int = 8000
    interval_s: float = 10.0
    scheme: str = "http"
    nameserver: str | None = None
    timeout_s: float = 2.0
    allow_empty: bool = False

    @classmethod
    def from_config(cls, config: Any) -> DnsDiscoveryConfig | None:
        """From an object with ``discovery_*`` attributes (the gateway's ``config.discovery``); None
        when ``discovery_dns`` is not set."""
        if not getattr(config, "discovery_dns", None):
            return None
        raw = {
            f: getattr(config, f"discovery_{f}")
            for f in _FIELDS
            if getattr(config, f"discovery_{f}", None) is not None
        }
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> DnsDiscoveryConfig:
        """From ``{"dns": ..., "port": ..., ...}`` (unprefixed keys), validated."""
        unknown = set(raw) - set(_FIELDS)
        if unknown:
            raise ValueError(f"discovery: unknown keys {sorted(unknown)}")
        if not raw.get("dns"):
            raise ValueError("discovery: 'dns' (the name to resolve) is required")
        cfg = cls(
            dns=str(raw["dns"]),
            port=int(raw.get("port", 8000)),
            interval_s=float(raw.get("interval_s", 10.0)),
            scheme=str(raw.get("scheme", "http")),
            nameserver=str(raw["nameserver"]) if raw.get("nameserver") else None,
            timeout_s=float(raw.get("timeout_s", 2.0)),
            allow_empty=bool(raw.get("allow_empty", False)),
        )
        if not 0 < cfg.port < 65536:
            raise ValueError(f"discovery: bad port {cfg.port}")
        if cfg.interval_s <= 0 or cfg.timeout_s <= 0:
            raise ValueError("discovery: interval_s and timeout_s must be > 0")
        if cfg.scheme not in ("http", "https"):
            raise ValueError(f"discovery: scheme must be http or https, not {cfg.scheme!r}")
        return cfg


class DnsDiscovery:
    """Re-resolves ``name`` every ``interval_s`` and calls ``on_change(urls)`` (sorted,
    de-duplicated ``scheme://IP:PORT``) whenever the set differs from the last one delivered.

    ``start()`` performs the first lookup before returning (so the fleet has replicas before
    the gateway reports ready) and then keeps refreshing in a background task; ``stop()``
    cancels it. If ``on_change`` raises, the new set is not recorded and is offered again at
    the next refresh.
    """

    def __init__(
        self,
        name: str,
        port: int,
        on_change: OnChange,
        *,
        interval_s: float = 10.0,
        resolver: Resolver | None = None,
        scheme: str = "http",
        timeout_s: float = 5.0,
        allow_empty: bool = False,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.name = name
        self.port = port
        self.interval_s = interval_s
        self.scheme = scheme
        self.timeout_s = timeout_s
        self.allow_empty = allow_empty
        self._on_change = on_change
        self._resolver: Resolver = resolver or system_resolver
        self._urls: list[str] | None = None  # None: nothing delivered yet
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @classmethod
    def from_config(
        cls,
        cfg: DnsDiscoveryConfig | Mapping[str, Any] | Any,
        on_change: OnChange,
        *,
        resolver: Resolver | None = None,
    ) -> DnsDiscovery:
        """From a :class:`DnsDiscoveryConfig`, an unprefixed mapping, or the gateway's
        ``config.discovery`` (its ``discovery_*`` fields)."""
        if isinstance(cfg, Mapping):
            cfg = DnsDiscoveryConfig.from_mapping(cfg)
        elif not isinstance(cfg, DnsDiscoveryConfig):
            found = DnsDiscoveryConfig.from_config(cfg)
            if found is None:
                raise ValueError("discovery_dns is not set")
            cfg = found
        if resolver is None and cfg.nameserver:
            resolver = udp_resolver(parse_nameserver(cfg.nameserver), timeout=cfg.timeout_s)
        return cls(
            cfg.dns,
            cfg.port,
            on_change,
            interval_s=cfg.interval_s,
            resolver=resolver,
            scheme=cfg.scheme,
            timeout_s=cfg.timeout_s * 3,
            allow_empty=cfg.allow_empty,
        )

    @property
    def urls(self) -> list[str]:
        """The last set delivered to ``on_change`` (empty before the first)."""
        return list(self._urls or [])

    @property
    def healthy(self) -> bool:
        """False while lookups are failing (the last good set is still in use)."""
        return not self._failing

    async def refresh(self) -> bool:
        """One lookup; True when ``on_change`` was called with a new set."""
        try:
            ips = await asyncio.wait_for(self._resolver(self.name, self.port), self.timeout_s)
            if not ips and not self.allow_empty:
                raise DnsError("no addresses")
            urls = replica_urls(ips, self.port, self.scheme)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any resolver failure keeps the last set
            if not self._failing:
                self._failing = True
                log.warning(
                    "discovery: resolving %s failed (%s); keeping the last %d replica(s)",
                    self.name,
                    str(exc) or type(exc).__name__,
                    len(self._urls or []),
                )
            return False
        if self._failing:
            self._failing = False
            log.info("discovery: resolving %s works again (%d address(es))", self.name, len(urls))
        if urls == self._urls:
            return False
        try:
            await self._on_change(urls)
        except asyncio.CancelledError:
            raise
        except Exception:  # retried at the next refresh
            log.exception("discovery: on_change failed; will retry at the next refresh")
            return False
        log.info("discovery: %s -> %s", self.name, urls)
        self._urls = urls
        return True

    def poke(self) -> None:
        """Refresh now instead of waiting for the rest of the interval."""
        self._wake.set()

    async def start(self) -> None:
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name=f"dns-discovery:{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def __aenter__(self) -> DnsDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything
                log.exception("discovery: refresh of %s crashed", self.name)
