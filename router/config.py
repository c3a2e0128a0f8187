"""One typed configuration, from defaults < a YAML file < environment < flags.

Every field is a flag (``--block-size``), a config key (``block_size``) and an environment
variable (``PREFIX_ROUTER_BLOCK_SIZE``; lists comma-separated). ``prefix-router serve
--print-config`` prints the effective result.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.schedule import DEFAULT_POLICY, ScheduleError, check_config, policy_names
from router.schedule.spec import lift as lift_schedule

ENV_PREFIX = "PREFIX_ROUTER_"


class ConfigError(ValueError):
    """Configuration problems, phrased for the person who wrote the config: ``problems``
    lists every one found (the message is them, one a line)."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def _opt(default: Any, help: str, *, flag: bool = True, secret: bool = False) -> Any:
    meta = {"help": help, "flag": flag, "secret": secret}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # a copy
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # -- serving
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = _opt(8000, "port to listen on")
    replicas: list[str] = _opt(
        [], "a vLLM replica base URL, e.g. http://10.0.0.1:8000 (repeatable)"
    )
    tokenizer: str | None = _opt(
        None,
        "tokenizer directory or model id (default: the model the replicas report, "
        "loaded from the local Hugging Face cache)",
    )
    block_size: int | None = _opt(
        None,
        "prefix-cache block size in tokens (default: what the replicas report in "
        "vllm:cache_config_info, else 16)",
    )
    policy: str = _opt(
        DEFAULT_POLICY,
        f"routing policy: {', '.join(policy_names())} (ring_spill: keep a prefix on as few "
        "replicas as its traffic needs, spill along its own ring under pressure; ttft: lowest "
        "estimated time to first token; the others are baselines)",
    )
    metrics_port: int | None = _opt(
        None,
        "also serve /metrics on this port without a key (for Prometheus; with auth on, "
        "/metrics on the main port needs the admin key)",
    )
    log_level: str = _opt("info", "debug, info, warning or error")
    # -- routing
    max_hashed_blocks: int = _opt(4096, "hash at most this many leading blocks per request")
    capacity_blocks: int | None = _opt(
        None,
        "blocks each replica's prefix cache holds (default: num_gpu_blocks reported by "
        "the replica, else 65536)",
    )
    load_bound: float = _opt(
        1.25,
        "bounded-load factor c: no replica takes a request while it "
        "has more than c x the mean in-flight requests",
    )
    virtual_nodes: int = _opt(160, "virtual nodes per replica on the consistent-hash ring")
    decode_cost_tokens: float = _opt(
        8.0,
        "cost of one running (decoding) request, in prompt-token equivalents, in the "
        "ttft policy's estimate",
    )
    schedule: dict[str, Any] = _opt(
        {},
        "the policy's parameters or a full plugin profile (config file only; see "
        "docs/scheduling.md)",
        flag=False,
    )
    # -- fleet
    health_interval_s: float = _opt(2.0, "seconds between active /health checks")
    metrics_interval_s: float = _opt(1.0, "seconds between scrapes of the replicas' /metrics")
    eject_after_failures: int = _opt(
        3,
        "consecutive request failures (5xx, timeouts, connection errors) that eject a replica",
    )
    outlier_window_s: float = _opt(
        10.0, "seconds of request outcomes the error-ratio ejection looks at"
    )
    outlier_min_requests: int = _opt(
        10, "outcomes in the window before a replica can be ejected on its error ratio"
    )
    outlier_error_ratio: float = _opt(
        0.5,
        "eject a replica when more than this share of its recent requests failed (5xx, "
        "timeouts, connection errors; never 4xx)",
    )
    ejection_base_s: float = _opt(
        5.0, "an ejection lasts this x the replica's recent ejections; /health cannot end it"
    )
    ejection_max_s: float = _opt(300.0, "longest ejection")
    ejection_decay_s: float = _opt(
        30.0, "a replica in rotation this long has one recent ejection forgiven"
    )
    max_ejected_percent: float = _opt(
        50.0,
        "at most this share of the replicas is ejected at once (at least one of two or "
        "more; never the last in rotation)",
    )
    # -- forwarding
    connect_timeout_s: float = _opt(5.0, "upstream connect timeout")
    first_byte_timeout_s: float = _opt(
        600.0,
        "upstream time to response headers, at most (a non-streaming answer's headers come "
        "after its last token); the timeout used is derived from the replica's observed "
        "answer times",
    )
    first_byte_timeout_factor: float = _opt(
        3.0, "time-to-headers timeout = this x the replica's usual (about p99) answer time"
    )
    first_byte_timeout_floor_s: float = _opt(
        10.0, "the derived time-to-headers timeout is never shorter than this"
    )
    idle_timeout_s: float = _opt(600.0, "upstream max silence between streamed chunks")
    max_retries: int = _opt(2, "retries on another replica when one fails before the first byte")
    max_body_bytes: int = _opt(32 * 1024 * 1024, "largest accepted request body")
    body_timeout_s: float = _opt(
        60.0, "seconds a client may take to send a request body once its headers are in"
    )
    max_inflight_body_bytes: int = _opt(
        256 * 1024 * 1024,
        "request-body bytes all clients together may be sending at once (counted as they "
        "arrive); beyond it, or beyond one client's client_share of it, a 503",
    )
    client_share: float = _opt(
        0.25,
        "the fraction of max_inflight_body_bytes and of max_connections one client may hold "
        "(a tenant with auth on, else a peer address; 1: no per-client bound)",
    )
    max_prompt_chars: int = _opt(4_000_000, "largest rendered prompt, in characters")
    max_tokenize_cpu_s: float = _opt(
        2.0,
        "CPU seconds one request's new (uncached) prompt text may take to tokenize; beyond "
        "it the request is refused with a 413 (raise it for very long contexts)",
    )
    # -- client connections (router/server.py)
    max_connections: int = _opt(
        10_000,
        "open client connections at most; a connection beyond it is answered 503 and closed "
        "(/health and /ready are still answered)",
    )
    header_timeout_s: float = _opt(
        10.0,
        "seconds a connection may take to send a complete request head (slowloris guard); "
        "past it, a 408 and the connection closed",
    )
    keepalive_timeout_s: float = _opt(
        75.0,
        "an idle keep-alive client connection is closed after this many seconds (behind a "
        "load balancer, set it above the balancer's idle timeout)",
    )
    unauthenticated_keepalive_s: float = _opt(
        5.0,
        "the keep-alive of a connection that has not yet carried a request with a valid key "
        "(with auth off: any API request); probes and keyless clients do not hold slots",
    )
    # -- request-body limits (router/limits.py: checked before any recursive work)
    max_json_depth: int = _opt(64, "deepest JSON nesting accepted inside any field of a body")
    max_json_nodes: int = _opt(1_000_000, "most JSON values (objects, arrays, scalars) in a body")
    max_string_chars: int = _opt(8 * 1024 * 1024, "longest JSON string (or key) in a body")
    max_messages: int = _opt(20_000, "most messages in a chat request")
    max_content_parts: int = _opt(1_024, "most content parts in one message")
    max_tools: int = _opt(512, "most tools in a request (or in one message)")
    max_template_kwargs: int = _opt(256, "most keys in chat_template_kwargs")
    decision_headers: bool | None = _opt(
        None,
        "add x-prefix-router-replica and x-prefix-router-cached-blocks to responses (default: "
        "on with auth off, off with auth on; with auth on the replica is named replica-<n>, "
        "never by its URL)",
    )
    forward_headers: list[str] = _opt(
        [],
        "client headers forwarded to replicas besides the built-in allow-list (Accept, "
        "User-Agent, traceparent/tracestate/baggage, OpenAI-Beta, anthropic-version...); "
        "empty with auth off forwards every header but hop-by-hop ones",
    )
    upstream_api_key: str | None = _opt(
        None, "bearer token sent to the replicas (vLLM --api-key)", secret=True
    )
    workers: int = _opt(
        1,
        "gateway processes sharing the port (SO_REUSEPORT); use with "
        "redis_url so they share one prefix map",
    )
    lazy_tail: bool = _opt(
        True,
        "route on a prompt's head and tokenize the rest off the critical path where the "
        "decision is provably the same (router/lazy_tail.py)",
    )
    tokenize_threads: int = _opt(2, "threads that tokenize long prompts off the event loop")
    startup_wait_s: float = _opt(
        60.0,
        "with no --tokenizer, how long start-up waits for a replica to report its model "
        "(replicas started at the same time load for seconds)",
    )
    shutdown_grace_s: float = _opt(30.0, "on SIGTERM, seconds to let in-flight requests finish")
    # -- fleet mode (Redis)
    redis_url: str | None = _opt(
        None,
        "share the prefix map, ring and load with other "
        "gateways through this Redis, e.g. redis://host:6379/0",
    )
    redis_prefix: str = _opt("prefix-router", "namespace prefix of every Redis key")
    redis_timeout_ms: float = _opt(10.0, "Redis lookup timeout; on timeout route locally")
    sync_interval_s: float = _opt(
        0.5, "seconds between publishing this gateway's load to Redis and reading the others'"
    )
    redis_refresh_blocks: int = _opt(
        64,
        "a Redis record writes the blocks new to the replica and refreshes at most this many "
        "it already held (0: rewrite every block of the prompt each time)",
    )
    # -- precise mode (vLLM KV cache events)
    kv_events: bool = _opt(
        False,
        "subscribe to each replica's vLLM KV cache events (ZMQ) and keep the index exact "
        "from them; a replica whose events stop is routed on the approximate model",
    )
    kv_events_port: int = _opt(
        5557, "port of a replica's KV event publisher (on the replica's host) when not listed"
    )
    kv_events_replay_port: int | None = _opt(
        None,
        "port of a replica's KV event replay socket (vLLM's replay_endpoint) when not "
        "listed; without one, a gap in the events resets the replica's index",
    )
    kv_events_endpoints: dict[str, Any] = _opt(
        {},
        "replica URL -> its publisher, tcp://host:port or {endpoint, replay_endpoint} "
        "(config file only)",
        flag=False,
    )
    kv_events_topic: str = _opt("", "topic of the KV event messages (vLLM's kv-events topic)")
    kv_events_timeout_s: float = _opt(
        10.0,
        "a replica that sends no event this long after being sent new blocks is routed on "
        "the approximate model until its events resume",
    )
    # -- discovery
    discovery_dns: str | None = _opt(
        None, "discover replicas by resolving this DNS name (e.g. a headless Service) periodically"
    )
    discovery_port: int = _opt(8000, "port of replicas found by DNS discovery")
    discovery_interval_s: float = _opt(10.0, "seconds between DNS discovery lookups")
    # -- tenancy
    auth: bool = _opt(False, "require Authorization: Bearer <key> (keys from api_keys_file)")
    api_keys_file: str | None = _opt(
        None, "YAML file mapping tenants to API keys or their sha256 hashes"
    )
    tenant_header: str | None = _opt(
        None, "with auth off, a header that names the tenant (trust-the-client)"
    )
    salt_policy: str = _opt(
        "auto",
        "default cache_salt policy: none, tenant, tenant+client, "
        "reject, or auto (tenant when auth is on, else pass-through)",
    )
    salt_secret: str | None = _opt(None, "server secret keying tenant salts", secret=True)
    tenants: dict[str, Any] = _opt({}, "per-tenant overrides (config file only)", flag=False)
    # -- models (router/models/; docs/models.md)
    models: dict[str, Any] = _opt(
        {},
        "per served model: tokenizer, chat_template, block_size, aliases, adapters (config "
        "file only; docs/models.md)",
        flag=False,
    )
    model_aliases: dict[str, Any] = _opt(
        {}, "client-facing model name -> served model (config file only)", flag=False
    )
    lora_runtime_loading: bool = _opt(
        False,
        "load a LoRA adapter named under models: ... adapters: on the replica the scheduler "
        "picks when no replica has it (vLLM's /v1/load_lora_adapter; the replicas need "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    public_prefixes: dict[str, Any] = _opt(
        {}, "named public prefixes (config file only)", flag=False
    )
    # -- flow control (router/flow/)
    flow_control: bool = _opt(
        False,
        "while a model's replicas are saturated, queue requests in the gateway and release "
        "them in weighted fair order per tenant (weights, bands, rate limits in the tenancy "
        "table; docs/flow-control.md)",
    )
    flow_prefill_per_replica: float = _opt(
        1.0,
        "requests in prefill (sent, no first byte yet) each replica may have before requests "
        "wait in the gateway: vLLM's own queue cannot be reordered",
    )
    flow_waiting_max: int = _opt(
        4, "a replica reporting this many vllm:num_requests_waiting takes no released request"
    )
    flow_kv_usage_max: float = _opt(
        0.95, "a replica at this vllm:kv_cache_usage_perc takes no released request"
    )
    flow_ttft_max_s: float = _opt(
        0.0,
        "a replica whose observed time to first byte (mostly cached requests) is over this "
        "takes no released request (0: not used)",
    )
    flow_max_queue_per_tenant: int = _opt(
        256, "requests of one tenant waiting at most; beyond it a 429 (tenants.<t>.max_queue)"
    )
    flow_max_queue: int = _opt(
        4096,
        "requests waiting in all at most; beyond it the newest of the lowest band is shed "
        "(429) for a higher band's, or the newcomer is",
    )
    flow_queue_timeout_s: float = _opt(
        30.0,
        "longest wait in the queue; beyond it a 429 with Retry-After (tenants.<t>.queue_timeout_s)",
    )
    flow_decode_token_cost: float = _opt(
        1.0,
        "prefill tokens one expected output token costs in a request's fair-queuing cost "
        "(uncached prompt tokens + this x max_tokens)",
    )
    flow_history_tokens: float = _opt(
        200_000.0,
        "how much of a tenant's past work (tokens per unit weight) may hold it back when a "
        "queue forms, e.g. work other gateways report",
    )
    # -- admin
    admin_key: str | None = _opt(
        None, "key for admin endpoints (/admin/*, /v1/route/explain)", secret=True
    )
    admin_networks: list[str] = _opt(
        ["127.0.0.0/8", "::1/128"],
        "with no admin_key, /v1/route/explain answers only clients from these networks "
        "(default: loopback; empty: off)",
    )

    def validate(self) -> Config:
        """This config, or a ConfigError listing every problem in it (not just the first)."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def problems(self) -> list[str]:
        """Every problem with this config's values, one sentence each."""
        problems: list[str] = []
        if not 0 < self.port < 65536:
            problems.append(f"port must be 1..65535, got {self.port}")
        if self.metrics_port is not None and not (
            0 < self.metrics_port < 65536 and self.metrics_port != self.port
        ):
            problems.append(
                f"metrics_port must be 1..65535 and differ from port, got {self.metrics_port}"
            )
        if self.block_size is not None and self.block_size <= 0:
            problems.append(f"block_size must be positive, got {self.block_size}")
        from router.models.spec import ModelSpecError, alias_map, parse_models

        try:
            alias_map(parse_models(self.models), self.model_aliases)
        except ModelSpecError as e:
            problems.append(str(e))
        if self.body_timeout_s <= 0:
            problems.append(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.max_inflight_body_bytes < self.max_body_bytes:
            problems.append(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes})"
            )
        if not 0 < self.client_share <= 1:
            problems.append(f"client_share must be in (0, 1], got {self.client_share}")
        for net in self.admin_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                problems.append(f"admin_networks: {net!r} is not a network (e.g. 127.0.0.0/8)")
        for name in (
            "max_json_depth",
            "max_json_nodes",
            "max_string_chars",
            "max_messages",
            "max_content_parts",
            "max_tools",
            "max_template_kwargs",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 1:
            problems.append(f"workers must be >= 1, got {self.workers}")
        if self.load_bound < 1.0:
            problems.append(f"load_bound must be >= 1.0, got {self.load_bound}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            problems.append(
                f"log_level must be debug, info, warning or error, got {self.log_level!r}"
            )
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                problems.append(f"replica URL must start with http:// or https://: {url!r}")
        positive = (
            "outlier_window_s",
            "ejection_base_s",
            "ejection_max_s",
            "ejection_decay_s",
            "connect_timeout_s",
            "first_byte_timeout_s",
            "first_byte_timeout_floor_s",
            "idle_timeout_s",
            "header_timeout_s",
            "keepalive_timeout_s",
            "unauthenticated_keepalive_s",
            "max_tokenize_cpu_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.eject_after_failures < 1 or self.outlier_min_requests < 1:
            problems.append("eject_after_failures and outlier_min_requests must be >= 1")
        if not 0 < self.outlier_error_ratio < 1:
            problems.append(
                f"outlier_error_ratio must be between 0 and 1, got {self.outlier_error_ratio}"
            )
        if not 0 <= self.max_ejected_percent <= 100:
            problems.append(f"max_ejected_percent must be 0..100, got {self.max_ejected_percent}")
        if self.first_byte_timeout_factor < 1:
            problems.append(
                f"first_byte_timeout_factor must be >= 1, got {self.first_byte_timeout_factor}"
            )
        if not 0 < self.kv_events_port < 65536 or (
            self.kv_events_replay_port is not None and not 0 < self.kv_events_replay_port < 65536
        ):
            problems.append("kv_events_port and kv_events_replay_port must be 1..65535")
        if self.redis_refresh_blocks < 0:
            problems.append(
                f"redis_refresh_blocks must be >= 0 (0: every block), got {self.redis_refresh_blocks}"
            )
        if self.kv_events_timeout_s <= 0:
            problems.append(f"kv_events_timeout_s must be positive, got {self.kv_events_timeout_s}")
        for url, ep in self.kv_events_endpoints.items():
            given = ep.get("endpoint") if isinstance(ep, dict) else ep
            if not isinstance(given, str) or not given.startswith(("tcp://", "ipc://")):
                problems.append(
                    f"kv_events_endpoints[{url!r}] must be tcp://host:port (or a mapping with "
                    "endpoint and replay_endpoint)"
                )
        for url in self.replicas:
            if url.rstrip("/").endswith("/v1"):
                problems.append(
                    f"replica URL {url!r} ends in /v1: give vLLM's base URL "
                    f"({url.rstrip('/').removesuffix('/v1')}); the gateway adds the paths"
                )
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            problems.append(
                f"redis_url must start with redis://, rediss:// or unix://, got "
                f"{mask_url_credentials(self.redis_url)!r} (e.g. redis://127.0.0.1:6379/0)"
            )
        if self.flow_prefill_per_replica <= 0 or self.flow_queue_timeout_s <= 0:
            problems.append("flow_prefill_per_replica and flow_queue_timeout_s must be positive")
        if min(self.flow_max_queue, self.flow_max_queue_per_tenant, self.flow_waiting_max) < 1:
            problems.append(
                "flow_max_queue, flow_max_queue_per_tenant and flow_waiting_max must be >= 1"
            )
        if not 0 < self.flow_kv_usage_max <= 1 or self.flow_ttft_max_s < 0:
            problems.append("flow_kv_usage_max must be in (0, 1] and flow_ttft_max_s >= 0")
        if self.flow_decode_token_cost < 0 or self.flow_history_tokens < 0:
            problems.append("flow_decode_token_cost and flow_history_tokens must be >= 0")
        try:
            check_config(self)
        except ScheduleError as e:
            problems.append(str(e))
        return problems

    def redacted(self) -> dict[str, Any]:
        """The effective config as a dict, with secrets masked (safe to print or log)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("secret") and value:
                value = "***"
            elif isinstance(value, str):
                value = mask_url_credentials(value)
            elif isinstance(value, list):
                value = [mask_url_credentials(v) if isinstance(v, str) else v for v in value]
            out[f.name] = value
        return out


_URL_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def mask_url_credentials(text: str) -> str:
    """``redis://user:secret@host`` -> ``redis://***@host``: a URL's user info never shows."""
    return _URL_CREDENTIALS.sub(r"\1***@", text)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the concrete type, whether None is allowed) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(name: str, tp: Any, value: Any, source: str) -> Any:
    base, nullable = _base_type(tp)
    if value is None or (nullable and isinstance(value, str) and value.lower() in ("", "none")):
        if nullable:
            return None
        raise ConfigError(f"{source}: {name} must not be empty")
    origin = typing.get_origin(base) or base
    try:
        if origin is list:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [str(i).strip() for i in items if str(i).strip()]
        if origin is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {name} must be a mapping")
            return value
        if origin is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if origin is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if origin is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}: {name} must be {getattr(origin, '__name__', origin)}, got {value!r}"
        ) from None


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _readable(name: str, default: Any) -> str:
    """A default as a person reads it: byte sizes in MiB/KiB (33554432 -> 32 MiB)."""
    if name.endswith("_bytes") and isinstance(default, int) and default >= 1024:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default % size == 0:
                return f"{default // size} {unit} = {default}"
    return str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so only flags the user gave override."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (keys as the long flags, with underscores)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (secrets masked) and exit",
    )
    hints = _hints()
    for f in dataclasses.fields(Config):
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        base, _ = _base_type(hints[f.name])
        env = ENV_PREFIX + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = (
            ""
            if f.metadata.get("secret") or default in (None, [], {})
            else f" (default: {_readable(f.name, default)})"
        )
        help_text = f"{f.metadata['help']}{shown} [env {env}]"
        if f.name == "replicas":
            parser.add_argument(
                "--replica",
                dest="replicas",
                action="append",
                metavar="URL",
                default=None,
                help=help_text,
            )
        elif (typing.get_origin(base) or base) is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text
            )


# Optional nested sections of the YAML file: ``fleet: {redis_url: ...}`` sets what the flat key
# ``redis_url`` sets (flags and PREFIX_ROUTER_* names stay flat). Inside a section a key may
# drop the section's prefix (``kv_events: {port: 5557}``), and ``enabled`` is the switch the
# section is named after. A new field is a YAML key with no entry here; a new section is one.
@dataclass(frozen=True)
class Section:
    fields: tuple[str, ...]
    prefix: str = ""  # dropped from a field's name inside the section
    enabled: str | None = None  # the field ``enabled:`` sets

    def keys(self) -> dict[str, str]:
        """Key inside the section -> field."""
        out = {name: name for name in self.fields}
        out.update(
            {n.removeprefix(self.prefix): n for n in self.fields if n.startswith(self.prefix)}
        )
        if self.enabled:
            out["enabled"] = self.enabled
        return out


SECTIONS: dict[str, Section] = {
    "server": Section(
        (
            "host",
            "port",
            "metrics_port",
            "log_level",
            "workers",
            "tokenize_threads",
            "startup_wait_s",
            "shutdown_grace_s",
        ),
    ),
    "routing": Section(
        (
            "tokenizer",
            "block_size",
            "policy",
            "max_hashed_blocks",
            "capacity_blocks",
            "load_bound",
            "virtual_nodes",
            "decode_cost_tokens",
            "lazy_tail",
            "decision_headers",
        ),
    ),
    "health": Section(
        (
            "health_interval_s",
            "metrics_interval_s",
            "eject_after_failures",
            "outlier_window_s",
            "outlier_min_requests",
            "outlier_error_ratio",
            "ejection_base_s",
            "ejection_max_s",
            "ejection_decay_s",
            "max_ejected_percent",
        ),
    ),
    "forwarding": Section(
        (
            "connect_timeout_s",
            "first_byte_timeout_s",
            "first_byte_timeout_factor",
            "first_byte_timeout_floor_s",
            "idle_timeout_s",
            "max_retries",
            "forward_headers",
            "upstream_api_key",
        ),
    ),
    "limits": Section(
        (
            "max_body_bytes",
            "body_timeout_s",
            "max_inflight_body_bytes",
            "client_share",
            "max_prompt_chars",
            "max_tokenize_cpu_s",
            "max_connections",
            "header_timeout_s",
            "keepalive_timeout_s",
            "max_json_depth",
            "max_json_nodes",
            "max_string_chars",
            "max_messages",
            "max_content_parts",
            "max_tools",
            "max_template_kwargs",
        ),
    ),
    "fleet": Section(
        (
            "redis_url",
            "redis_prefix",
            "redis_timeout_ms",
            "sync_interval_s",
            "redis_refresh_blocks",
        ),
        prefix="redis_",
    ),
    "kv_events": Section(
        (
            "kv_events_port",
            "kv_events_replay_port",
            "kv_events_endpoints",
            "kv_events_topic",
            "kv_events_timeout_s",
        ),
        prefix="kv_events_",
        enabled="kv_events",
    ),
    "discovery": Section(
        ("discovery_dns", "discovery_port", "discovery_interval_s"), prefix="discovery_"
    ),
    "auth": Section(
        (
            "api_keys_file",
            "tenant_header",
            "salt_policy",
            "salt_secret",
            "tenants",
            "public_prefixes",
            "admin_key",
            "admin_networks",
        ),
        enabled="auth",
    ),
}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'block_size'?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _flatten(data: dict[Any, Any], path: str, problems: list[str]) -> dict[str, Any]:
    """The file's keys as fields: sections opened, aliases resolved, unknown keys reported."""
    names = {f.name for f in dataclasses.fields(Config)}
    out: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(name: str, value: Any, key: str) -> None:
        if name in out:
            problems.append(f"{path}: {name} is set twice ({where[name]} and {key})")
            return
        out[name], where[name] = value, key

    for key, value in data.items():
        name = str(key).replace("-", "_")
        section = SECTIONS.get(name)
        if section is not None and isinstance(value, dict):
            inner = section.keys()
            for k, v in value.items():
                kname = str(k).replace("-", "_")
                if kname in inner:
                    put(inner[kname], v, f"{name}.{k}")
                else:
                    hint = did_you_mean(kname, inner)
                    problems.append(f"{path}: unknown key {k!r} in section {name!r}{hint}")
            continue
        if name == "replica":
            name = "replicas"
        if name in names:
            put(name, value, str(key))
        else:
            hint = did_you_mean(name, [*names, *SECTIONS])
            problems.append(f"{path}: unknown key {key!r}{hint}")
    return out


def load_config(
    args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **overrides: Any
) -> Config:
    """Defaults < ``--config`` file < ``PREFIX_ROUTER_*`` environment < flags < overrides.
    Every problem found is reported at once, in one ConfigError."""
    env = dict(os.environ) if env is None else env
    hints = _hints()
    names = {f.name for f in dataclasses.fields(Config)}
    values: dict[str, Any] = {}
    problems: list[str] = []

    def coerce(name: str, value: Any, source: str) -> None:
        try:
            values[name] = _coerce(name, hints[name], value, source)
        except ConfigError as e:
            problems.extend(e.problems)

    path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must be a mapping of keys to values")
        for name, value in _flatten(data, path, problems).items():
            coerce(name, value, path)
        if "schedule" in values:  # its policy and knobs are the top-level settings too
            try:
                lifted = lift_schedule(values["schedule"])
            except ScheduleError as e:
                problems.append(f"{path}: {e}")
                lifted = {}
            for name, value in lifted.items():
                try:
                    same = name not in values or values[name] == _coerce(
                        name, hints[name], value, path
                    )
                except ConfigError as e:
                    problems.extend(e.problems)
                    continue
                if not same:
                    problems.append(f"{path}: {name} is set twice (at top level and in schedule)")
                coerce(name, value, path)

    for name in names:
        key = ENV_PREFIX + name.upper()
        if key in env:
            coerce(name, env[key], f"environment {key}")

    if args is not None:
        for name in names:
            value = getattr(args, name, None)
            if value is not None:
                coerce(name, value, "--" + name.replace("_", "-"))

    for name, value in overrides.items():
        if name not in names:
            problems.append(f"unknown config key {name!r}{did_you_mean(name, names)}")
            continue
        values[name] = value
    config = Config(**values)
    problems += config.problems()
    if problems:
        raise ConfigError(problems)
    return config


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.redacted(), sort_keys=False)
