"""The Redis client fleet mode talks to, chosen by the URL's scheme.

* ``redis://`` / ``rediss://`` / ``unix://``: one server (``redis.asyncio.Redis.from_url``).
* ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://`` for TLS):
  a Redis Cluster reached through these seed nodes (``RedisCluster``). Every key a script or
  pipeline of the gateway touches shares one hash tag (docs/fleet-mode.md, "Key layout"), so
  each call is one slot on one master; MOVED/ASK and topology refreshes are redis-py's.
* ``redis+sentinel://[user:pass@]host:port[,host:port...]/MASTER_NAME[/db]``
  (``rediss+sentinel://`` for TLS to the master): the master the sentinels name
  (``Sentinel(...).master_for``); each new connection asks the sentinels again, so a promoted
  replica is picked up by itself. The password is the master's; the sentinels are asked
  without one.

No client-side retries anywhere: redis-py's default retries with backoff would hold a
request for seconds while a master is down; ``ResilientIndex`` does the failing over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from router.core.urls import mask_url_credentials

Kind = Literal["standalone", "cluster", "sentinel"]
Client = Redis | RedisCluster

PLAIN_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
SCHEMES = PLAIN_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES
DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed fleet-mode Redis URL."""

    kind: Kind
    url: str = field(repr=False)  # may carry a password
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seeds or sentinels
    master: str = ""  # sentinel: the monitored master's name
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False

    def describe(self) -> str:
        """For the start-up summary."""
        if self.kind == "cluster":
            return f"Redis Cluster, {len(self.nodes)} seed node(s)"
        if self.kind == "sentinel":
            return f"Redis Sentinel master {self.master!r} via {len(self.nodes)} sentinel(s)"
        return "one Redis server"


def _host_port(item: str, default_port: int, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port_s = rest.removeprefix(":")
    else:
        host, _, port_s = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"redis_url {url}: empty host in {item!r} (want host:port)")
    if not port_s:
        return host, default_port
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"redis_url {url}: bad port in {item!r} (want host:port, port 1..65535)")
    return host, int(port_s)


def parse_redis_url(url: str) -> RedisTarget:
    """The target of ``url``; ValueError (one line, credentials masked) when malformed."""
    shown = repr(mask_url_credentials(url))
    if not url.startswith(SCHEMES):
        raise ValueError(
            f"redis_url must start with {', '.join(s[:-3] + '://' for s in SCHEMES)}, got "
            f"{shown} (e.g. redis://127.0.0.1:6379/0)"
        )
    if url.startswith(PLAIN_SCHEMES):
        return RedisTarget("standalone", url)
    kind: Kind = "cluster" if url.startswith(CLUSTER_SCHEMES) else "sentinel"
    scheme, _, rest = url.partition("://")
    if "?" in rest or "#" in rest:
        raise ValueError(f"redis_url {shown}: {scheme}:// URLs take no query options")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, has_pw, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    if not hosts:
        raise ValueError(f"redis_url {shown}: no host:port after {scheme}://")
    nodes = tuple(_host_port(h, DEFAULT_PORT[kind], shown) for h in hosts.split(","))
    master, db = "", 0
    parts = [p for p in path.split("/")] if path else []
    if kind == "cluster":
        if parts not in ([], [""], ["0"]):
            raise ValueError(
                f"redis_url {shown}: a cluster has only database 0 (want "
                f"{scheme}://host:port[,host:port...])"
            )
    else:
        if (
            not parts
            or not parts[0]
            or len(parts) > 2
            or (len(parts) == 2 and not parts[1].isdigit())
        ):
            raise ValueError(
                f"redis_url {shown}: want {scheme}://host:port[,host:port...]/MASTER_NAME[/db]"
            )
        master = unquote(parts[0])
        db = int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget(
        kind, url, nodes, master, db, username, password, ssl=scheme.startswith("rediss")
    )


def make_client(
    url: str,
    *,
    socket_timeout: float = 1.0,
    connect_timeout: float = 0.5,
    max_connections: int | None = 64,
    **kwargs: Any,
) -> Client:
    """A client suited to the router for ``url`` (see the module doc): no client-side
    retries, short socket timeouts, bounded pools (per node on a cluster)."""
    target = parse_redis_url(url)
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        **kwargs,
    }
    if target.kind == "standalone":
        return Redis.from_url(url, max_connections=max_connections, **common)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            max_connections=max_connections or 2**31,
            ssl=target.ssl,
            **auth,
            **common,
        )
    sentinel = Sentinel(
        list(target.nodes),
        sentinel_kwargs={
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "retry": Retry(NoBackoff(), 0),
        },
    )
    return sentinel.master_for(
        target.master,
        db=target.db,
        max_connections=max_connections,
        ssl=target.ssl,
        **auth,
        **common,
    )


def fresh_pool(client: Client) -> ConnectionPool | None:
    """Give ``client`` a new, empty connection pool like its current one and return the old
    one (to close once its calls are over); None for a cluster, whose per-node connections
    redis-py marks for reconnection itself after a connection error."""
    if isinstance(client, RedisCluster):
        return None
    old = client.connection_pool
    kwargs = dict(old.connection_kwargs)
    if isinstance(old, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the new pool sets its own
        client.connection_pool = SentinelConnectionPool(
            old.service_name,
            old.sentinel_manager,
            is_master=old.is_master,
            check_connection=old.check_connection,
            connection_class=old.connection_class,
            max_connections=old.max_connections,
            **kwargs,
        )
    else:
        client.connection_pool = type(old)(
            connection_class=old.connection_class, max_connections=old.max_connections, **kwargs
        )
    return old


async def ping(client: Client) -> bool:
    """One round trip to every master (a cluster's primaries); raises when one is down."""
    if isinstance(client, RedisCluster):
        return bool(await client.ping(target_nodes=RedisCluster.PRIMARIES))
    return bool(await client.ping())


async def aclose(client: Client) -> None:
    """Close the client, and a sentinel client's connections to the sentinels too."""
    await client.aclose()
    if not isinstance(client, RedisCluster):
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            for s in pool.sentinel_manager.sentinels:
                await s.aclose()


def error_text(exc: BaseException) -> str:
    """``ConnectionError: Error 111 connecting to ...``: redis-py's exceptions' repr is only
    ``client:ConnectionError``, without what happened."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else repr(exc)
