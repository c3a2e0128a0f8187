"""DNS discovery over real sockets: a small authoritative DNS server (UDP + TCP on 127.0.0.1)
answers A/AAAA records from a dict the tests mutate, and ``router.fleet.discovery`` asks it with its
own DNS client. No sleeps: tests wait on queues/futures with timeouts or drive ``refresh()``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from router.fleet.discovery import (
    QTYPE_A,
    QTYPE_AAAA,
    DnsDiscovery,
    DnsDiscoveryConfig,
    DnsError,
    parse_nameserver,
    query,
    replica_url,
    replica_urls,
    system_resolver,
    udp_resolver,
)

NAME = "vllm-headless.default.svc.cluster.local"
WAIT = 5.0  # upper bound for anything the tests wait on


# ---------------------------------------------------------------------------- a DNS server


class FakeDns:
    """Answers ``records[name]`` (a list of IPv4/IPv6 strings). Names not in ``records`` get
    NXDOMAIN. ``mode``: "ok", "servfail", or "drop" (never answer). Over UDP, answers with more
    than ``udp_max_answers`` records are truncated (TC bit, no records), like a real server
    whose answer exceeds the client's payload size; TCP always gets the full answer."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.mode = "ok"
        self.udp_max_answers = 64
        self.queries: list[tuple[str, str, int]] = []  # (transport, name, qtype)
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.AbstractServer | None = None

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    async def start(self, port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                reply = server.answer(data, "udp")
                if reply is not None:
                    self.transport.sendto(reply, addr)

        for _ in range(20):  # UDP and TCP on the same port number
            udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", port))
            chosen = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", chosen)
            except OSError:
                udp.close()
                if port:
                    raise
                continue
            self._udp, self.port = udp, chosen
            return
        raise RuntimeError("no free port for UDP+TCP")

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
            self._tcp = None

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            reply = self.answer(await reader.readexactly(length), "tcp")
            if reply is not None:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        finally:
            writer.close()

    def answer(self, data: bytes, transport: str) -> bytes | None:
        qid, _flags, qdcount, _, _, _ = struct.unpack_from("!HHHHHH", data)
        assert qdcount == 1
        off, labels = 12, []
        while data[off]:
            labels.append(data[off + 1 : off + 1 + data[off]].decode())
            off += 1 + data[off]
        question = data[12 : off + 5]
        qtype = struct.unpack_from("!H", data, off + 1)[0]
        name = ".".join(labels).lower()
        self.queries.append((transport, name, qtype))
        if self.mode == "drop":
            return None
        rcode, rrs = 0, []
        if self.mode == "servfail":
            rcode = 2
        elif name not in self.records:
            rcode = 3
        else:
            for ip in self.records[name]:
                family = socket.AF_INET6 if ":" in ip else socket.AF_INET
                rtype = QTYPE_AAAA if family == socket.AF_INET6 else QTYPE_A
                if rtype != qtype:
                    continue
                rdata = socket.inet_pton(family, ip)
                rrs.append(struct.pack("!HHHIH", 0xC00C, rtype, 1, 5, len(rdata)) + rdata)
        flags = 0x8180 | rcode  # QR, RD, RA
        if transport == "udp" and len(rrs) > self.udp_max_answers:
            flags |= 0x0200
            rrs = []
        header = struct.pack("!HHHHHH", qid, flags, 1, len(rrs), 0, 0)
        return header + question + b"".join(rrs)


@pytest.fixture
async def dns() -> AsyncIterator[FakeDns]:
    server = FakeDns()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Changes:
    """on_change callback that records every set it is given."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[str]] = asyncio.Queue()
        self.calls: list[list[str]] = []

    async def __call__(self, urls: list[str]) -> None:
        self.calls.append(urls)
        await self.queue.put(urls)

    async def next(self) -> list[str]:
        return await asyncio.wait_for(self.queue.get(), WAIT)


# ---------------------------------------------------------------------------- the DNS client


async def test_query_a_and_aaaa(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.2", "10.0.0.1", "fd00::5"]
    assert sorted(await query(dns.address, NAME, QTYPE_A)) == ["10.0.0.1", "10.0.0.2"]
    assert await query(dns.address, NAME, QTYPE_AAAA) == ["fd00::5"]
    resolve = udp_resolver(dns.address)
    assert await resolve(NAME, 8000) == ["10.0.0.1", "10.0.0.2", "fd00::5"]


async def test_query_nxdomain_is_empty_and_servfail_raises(dns: FakeDns) -> None:
    assert await query(dns.address, "nope.example", QTYPE_A) == []
    dns.mode = "servfail"
    with pytest.raises(DnsError, match="rcode 2"):
        await query(dns.address, NAME, QTYPE_A)


async def test_truncated_udp_answer_falls_back_to_tcp(dns: FakeDns) -> None:
    ips = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(300)]
    dns.records[NAME] = ips
    dns.udp_max_answers = 10
    got = await query(dns.address, NAME, QTYPE_A)
    assert sorted(got) == sorted(ips)
    assert ("udp", NAME, QTYPE_A) in dns.queries and ("tcp", NAME, QTYPE_A) in dns.queries


async def test_query_timeout_and_refused(dns: FakeDns) -> None:
    dns.mode = "drop"
    with pytest.raises(DnsError, match="no answer"):
        await query(dns.address, NAME, QTYPE_A, timeout=0.2, attempts=2)
    assert len(dns.queries) == 2  # retried
    address = dns.address
    await dns.stop()
    with pytest.raises(DnsError):  # ICMP port unreachable -> refused (or a timeout)
        await query(address, NAME, QTYPE_A, timeout=0.5, attempts=1)


# ---------------------------------------------------------------------------- discovery


async def test_discovery_tracks_added_and_removed_records(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.1"]
    changes = Changes()
    disc = DnsDiscovery(NAME, 8000, changes, interval_s=3600, resolver=udp_resolver(dns.address))
    await disc.start()  # first lookup happens inside start()
    try:
        assert changes.calls == [["http://10.0.0.1:8000"]]
        assert disc.urls == ["http://10.0.0.1:8000"]

        dns.records[NAME] = ["10.0.0.2", "10.0.0.1", "fd00::7"]
        disc.poke()  # the background task refreshes now, not in an hour
        assert await changes.next() == ["http://10.0.0.1:8000"]  # from start()
        assert await changes.next() == [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://[fd00::7]:8000",
        ]

        dns.records[NAME] = ["10.0.0.2", "fd00::7"]
        disc.poke()
        assert await changes.next() == ["http://10.0.0.2:8000", "http://[fd00::7]:8000"]
    finally:
        await disc.stop()


async def test_no_callback_when_the_set_is_unchanged(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.1", "10.0.0.2"]
    changes = Changes()
    disc = DnsDiscovery(NAME, 8000, changes, resolver=udp_resolver(dns.address))
    assert await disc.refresh() is True
    dns.records[NAME] = ["10.0.0.2", "10.0.0.1", "10.0.0.2"]  # same set, other order, a dup
    assert await disc.refresh() is False
    assert await disc.refresh() is False
    assert len(changes.calls) == 1
    assert len(dns.queries) == 6  # it did ask each time (A + AAAA)


async def test_resolver_down_keeps_last_set_and_logs_once(
    dns: FakeDns, caplog: pytest.LogCaptureFixture
) -> None:
    dns.records[NAME] = ["10.0.0.1", "10.0.0.2"]
    changes = Changes()
    disc = DnsDiscovery(
        NAME,
        8000,
        changes,
        resolver=udp_resolver(dns.address, timeout=0.3, attempts=1),
        timeout_s=3,
    )
    assert await disc.refresh() is True
    port = dns.port
    await dns.stop()  # the nameserver is gone
    with caplog.at_level(logging.INFO, logger="router.fleet.discovery"):
        for _ in range(3):
            assert await disc.refresh() is False
        assert disc.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        assert not disc.healthy
        failures = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(failures) == 1, failures

        await dns.start(port)  # back, with a changed fleet
        dns.records[NAME] = ["10.0.0.3"]
        assert await disc.refresh() is True
        assert disc.healthy
        assert any("works again" in r.getMessage() for r in caplog.records)
    assert changes.calls[-1] == ["http://10.0.0.3:8000"]


async def test_empty_answer_keeps_last_set_unless_allowed(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.1"]
    changes = Changes()
    disc = DnsDiscovery(NAME, 8000, changes, resolver=udp_resolver(dns.address))
    assert await disc.refresh() is True
    del dns.records[NAME]  # NXDOMAIN, as for a headless Service with no ready pod
    assert await disc.refresh() is False
    assert disc.urls == ["http://10.0.0.1:8000"]

    allowing = DnsDiscovery(
        NAME, 8000, changes, resolver=udp_resolver(dns.address), allow_empty=True
    )
    allowing._urls = ["http://10.0.0.1:8000"]
    assert await allowing.refresh() is True
    assert changes.calls[-1] == []


async def test_failing_callback_is_retried(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.1"]
    seen: list[list[str]] = []

    async def flaky(urls: list[str]) -> None:
        seen.append(urls)
        if len(seen) == 1:
            raise RuntimeError("fleet not ready")

    disc = DnsDiscovery(NAME, 8000, flaky, resolver=udp_resolver(dns.address))
    assert await disc.refresh() is False
    assert disc.urls == []
    assert await disc.refresh() is True
    assert seen == [["http://10.0.0.1:8000"]] * 2


async def test_background_interval_and_stop(dns: FakeDns) -> None:
    dns.records[NAME] = ["10.0.0.1"]
    changes = Changes()
    # the gateway's Config shape: flat discovery_* attributes
    cfg = SimpleNamespace(
        discovery_dns=NAME,
        discovery_port=9000,
        discovery_interval_s=0.05,
        discovery_nameserver=f"127.0.0.1:{dns.port}",
    )
    async with DnsDiscovery.from_config(cfg, changes) as disc:
        assert await changes.next() == ["http://10.0.0.1:9000"]
        dns.records[NAME] = ["10.0.0.1", "10.0.0.9"]  # no poke: the interval picks it up
        assert await changes.next() == ["http://10.0.0.1:9000", "http://10.0.0.9:9000"]
        task = disc._task
        assert task is not None
    assert task.done()
    n = len(dns.queries)
    dns.records[NAME] = ["10.0.0.5"]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(changes.queue.get(), 0.2)
        pytest.fail("stopped discovery still calls on_change")
    assert len(dns.queries) == n


async def test_system_resolver_localhost() -> None:
    ips = await system_resolver("localhost", 8000)
    assert ips and set(ips) <= {"127.0.0.1", "::1"}
    assert await system_resolver("does-not-exist.invalid", 80) == []


# ---------------------------------------------------------------------------- helpers


def test_urls_and_nameserver_parsing() -> None:
    assert replica_url("10.0.0.1", 8000) == "http://10.0.0.1:8000"
    assert replica_url("fd00:0::1", 8000, "https") == "https://[fd00::1]:8000"
    assert replica_url("fe80::1%eth0", 80) == "http://[fe80::1%25eth0]:80"
    assert replica_urls(["10.0.0.2", "10.0.0.1", "10.0.0.2"], 1) == [
        "http://10.0.0.1:1",
        "http://10.0.0.2:1",
    ]
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("10.96.0.10:5353") == ("10.96.0.10", 5353)
    assert parse_nameserver("[fd00::a]:53") == ("fd00::a", 53)
    assert parse_nameserver("fd00::a") == ("fd00::a", 53)


def test_config_from_the_gateway_config() -> None:
    from router.config import load_config

    config = load_config(
        env={
            "PREFIX_ROUTER_DISCOVERY_DNS": NAME,
            "PREFIX_ROUTER_DISCOVERY_PORT": "8001",
            "PREFIX_ROUTER_DISCOVERY_INTERVAL_S": "5",
        }
    )
    cfg = DnsDiscoveryConfig.from_config(config.discovery)
    assert cfg is not None and (cfg.dns, cfg.port, cfg.interval_s) == (NAME, 8001, 5.0)
    assert DnsDiscoveryConfig.from_config(load_config(env={}).discovery) is None
    with pytest.raises(ValueError, match="discovery_dns"):
        DnsDiscovery.from_config(load_config(env={}).discovery, Changes())


def test_config_validation() -> None:
    cfg = DnsDiscoveryConfig.from_mapping({"dns": NAME, "port": "8000", "interval_s": 10})
    assert (cfg.dns, cfg.port, cfg.interval_s, cfg.nameserver) == (NAME, 8000, 10.0, None)
    with pytest.raises(ValueError, match="unknown keys"):
        DnsDiscoveryConfig.from_mapping({"dns": NAME, "intervall": 3})
    with pytest.raises(ValueError, match="required"):
        DnsDiscoveryConfig.from_mapping({"port": 8000})
    with pytest.raises(ValueError, match="port"):
        DnsDiscoveryConfig.from_mapping({"dns": NAME, "port": 0})


async def test_one_name_per_role_replaces_only_that_roles_replicas() -> None:
    """P/D: ``disaggregation: {prefill_dns, decode_dns}`` resolve into one role each
    (router/fleet/wiring.py): a change to one name's records leaves the other role alone."""
    import aiohttp

    from router.config import load_config
    from router.disagg import roles
    from router.fleet.replicas import Fleet

    config = load_config(env={}, pd_prefill_dns="prefill.test", pd_decode_dns="decode.test")
    assert roles.dns_names(config) == [("prefill", "prefill.test"), ("decode", "decode.test")]
    assert roles.disaggregating(config)
    closed = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4)]  # nothing listens there
    async with aiohttp.ClientSession() as session:
        fleet = Fleet([], session)
        await fleet.set_urls(closed[:1], "prefill")
        await fleet.set_urls(closed[1:3], "decode")
        await fleet.set_urls(closed[3:], "prefill")
        found = {url: r.role for url, r in fleet.replicas.items()}
    assert found == {closed[1]: "decode", closed[2]: "decode", closed[3]: "prefill"}
