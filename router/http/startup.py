"""What a started gateway says about itself: one summary block of what is on (replicas and
their health, models and tokenizer, block size and where it came from, the policy, fleet mode
and Redis, KV events, auth, the listen address), and "gateway ready" only once ``/ready``
answers 200 -- until then, what it waits for.

Called by the HTTP layer once the listener is up (router/http/app.py); reads the gateway, never
changes how it routes.
"""

from __future__ import annotations

import logging

from router import __version__
from router.config import mask_url_credentials
from router.fleet.replicas import Replica
from router.gateway import Gateway
from router.models import ModelEntry

log = logging.getLogger("prefix_router")


def waiting_for(gw: Gateway) -> str | None:
    """Why ``/ready`` answers 503 now, in words (None: it answers 200)."""
    return gw.readiness().waiting_for


def _state(r: Replica) -> str:
    if r.ejected:
        return f"{r.url}: ejected ({r.ejection_reason})"
    return f"{r.url}: {r.health_error or 'not checked yet'}"


def summary(gw: Gateway, url: str, ext_proc_port: int | None = None) -> list[str]:
    """The start-up block, one setting a line."""
    assert gw.fleet is not None
    config = gw.config
    replicas = list(gw.fleet.replicas.values())
    healthy = [r for r in replicas if r.healthy]
    down = [_state(r) for r in replicas if not r.healthy]
    where = f" (DNS {config.discovery.discovery_dns}, every {config.discovery.discovery_interval_s:g} s)"
    lines = [
        f"prefix-router {__version__} listening on {url}",
        f"  replicas    {len(replicas)} ({len(healthy)} healthy)"
        + (where if config.discovery.discovery_dns else "")
        + ("; down: " + "; ".join(down) if down else ""),
        f"  models      {', '.join(sorted(gw.fleet.models())) or 'none reported yet'}",
        f"  tokenizer   {gw.tokenizer_source}",
        f"  block size  {gw.block_size} ({gw.block_size_source})",
        f"  policy      {gw.policy.name}, lazy tail {'on' if gw.lazy_tail else 'off'}",
        f"  fleet mode  {_fleet_mode(gw)}",
        f"  KV events   {_kv_events(gw)}",
        f"  auth        {_auth(gw)}",
        f"  flow        {_flow(gw)}",
    ]
    if config.server.metrics_port:
        lines.append(
            f"  metrics     /metrics also on port {config.server.metrics_port} without a key"
        )
    if ext_proc_port is not None:
        lines.append(
            f"  ext_proc    endpoint picker on port {ext_proc_port} (gRPC: Envoy's "
            "ExternalProcessor and health)"
        )
    return lines


def _fleet_mode(gw: Gateway) -> str:
    config = gw.config
    if not config.fleet.redis_url:
        return "off (this gateway's own prefix map; --redis-url shares it)"
    index = gw.fleet_mode.index if gw.fleet_mode is not None else None
    state = "Redis up" if index is not None and index.redis_up else "Redis DOWN (routing locally)"
    kind = gw.fleet_mode.target.describe() if gw.fleet_mode is not None else "Redis"
    url = mask_url_credentials(config.fleet.redis_url)
    if config.fleet.redis_layout == "zsets":
        layout = "index in a sorted set per replica, written per request"
    elif config.kv_events.enabled:
        layout = "index in one hash per model, writes sent at once (KV events)"
    else:
        layout = (
            f"index in one hash per model, writes sent every {config.fleet.redis_flush_ms:g} ms"
        )
    return f"on, {url} ({kind}), prefix {config.fleet.redis_prefix!r}: {state}; {layout}"


def _kv_events(gw: Gateway) -> str:
    if gw.kv_events is None:
        return "off (the index is the gateway's model of the replicas' caches)"
    streams = gw.kv_events.streams
    up = sum(1 for s in streams.values() if s.connected)
    return f"on, {len(streams)} streams ({up} connected), topic {gw.config.kv_events.kv_events_topic!r}"


def _flow(gw: Gateway) -> str:
    config = gw.config
    chosen = "set" if config.flow.enabled is not None else "default"
    if not gw.path.flow.config.enabled:
        why = "" if chosen == "set" else ": one tenant (no auth, no tenant header)"
        return f"off ({chosen}{why})"
    t = gw.path.flow.config.thresholds
    return (
        f"on ({chosen}): fair queuing per tenant while replicas are full, "
        f"{t.prefill_per_replica:g} in prefill per replica while tenants contend, up to "
        f"{t.step_tokens} uncached prompt tokens for a tenant alone"
    )


def _auth(gw: Gateway) -> str:
    config = gw.config
    table = gw.tenancy.table
    salt = gw.tenancy.default_policy
    if not config.auth.enabled:
        header = f", tenant header {config.auth.tenant_header}" if config.auth.tenant_header else ""
        return f"off (client keys pass through to the replicas{header}), salt policy {salt}"
    admin = "set" if config.auth.admin_key else "not set (admin endpoints refused)"
    return (
        f"on, {len(table.keys)} keys for {len(table.tenants)} tenants, salt policy {salt}, "
        f"admin key {admin}"
    )


def announce(gw: Gateway, url: str, ext_proc_port: int | None = None) -> None:
    """Log the summary, then "gateway ready" now or, if ``/ready`` is 503, what it waits for
    and "gateway ready" once it is (router/readiness.py: a replica healthy, its models
    answered and their tokenizers settled)."""
    log.info("%s", "\n".join(summary(gw, url, ext_proc_port)))
    gw.listening = True
    blocked = waiting_for(gw)
    if blocked is None:
        _ready(gw, "")
        return
    log.warning("gateway not ready yet: /ready answers 503 while it waits for %s", blocked)

    def check(why: str) -> None:
        if not gw.announced_ready and waiting_for(gw) is None:
            gw.describe_models()  # the tokenizer it is ready with, not the one at listen
            _ready(gw, f" ({why}; tokenizer {gw.tokenizer_source})")

    async def on_event(replica: Replica, event: str) -> None:
        check(f"replica {replica.url}: {event}")

    def on_loaded(entry: ModelEntry) -> None:
        check(f"model {entry.name}: tokenizer {entry.state}")

    gw.fleet_listeners.append(on_event)
    gw.path.upkeep.on_loaded.append(on_loaded)


def _ready(gw: Gateway, why: str) -> None:
    assert gw.fleet is not None
    gw.announced_ready = True
    log.info(
        "gateway ready%s: %d replicas (%d healthy), policy %s, block size %d",
        why,
        len(gw.fleet.replicas),
        len(gw.fleet.healthy()),
        gw.policy.name,
        gw.block_size,
    )
