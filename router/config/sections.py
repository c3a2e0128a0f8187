"""The configuration's sections: one typed dataclass per concern (``Config``, holding them, is
in router/config/composed.py).

A field keeps its flat name inside its section (``config.fleet.redis_url`` is ``--redis-url``,
``redis_url:`` and ``PREFIX_ROUTER_REDIS_URL``), so a flag greps to the code that reads it; the
one exception is a section's switch, ``enabled``, whose flat name is the section's feature
(``config.kv_events.enabled`` is ``--kv-events``).
A part of the gateway takes the section it reads, not the whole ``Config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.schedule import DEFAULT_POLICY, policy_names


def _opt(
    default: Any, help: str, *, flag: bool = True, secret: bool = False, flat: str | None = None
) -> Any:
    """A field: its help line, whether it is a flag (else config file only), whether its value
    is masked when printed, and its flat name when that is not the field's own."""
    meta = {"help": help, "flag": flag, "secret": secret, "flat": flat}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # a copy
    return field(default=default, metadata=meta)


@dataclass
class Server:
    """Where and how the gateway process serves."""

    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = _opt(8000, "port to listen on")
    metrics_port: int | None = _opt(
        None,
        "also serve /metrics on this port without a key (for Prometheus; with auth on, "
        "/metrics on the main port needs the admin key)",
    )
    ext_proc_port: int | None = _opt(
        None,
        "also serve Envoy's ext_proc on this port as a Gateway API Inference Extension "
        "endpoint picker, with gRPC health (needs the ext-proc extra; 0: a free port)",
    )
    ext_proc_fallbacks: int = _opt(
        0,
        "endpoints the picker names after its pick in x-gateway-destination-endpoint, for "
        "Envoy to try when the pick refuses; 0 for gateways whose pool is an ORIGINAL_DST "
        "cluster on that header (llm-d's chart, kgateway, Envoy AI Gateway), which takes "
        "one host:port and answers 503 to a list",
    )
    log_level: str = _opt("info", "debug, info, warning or error")
    workers: int = _opt(
        1,
        "gateway processes sharing the port (SO_REUSEPORT); use with "
        "redis_url so they share one prefix map",
    )
    tokenize_threads: int = _opt(2, "threads that tokenize long prompts off the event loop")
    startup_wait_s: float = _opt(
        60.0,
        "with no --tokenizer, how long start-up waits for a replica to report its model "
        "(replicas started at the same time load for seconds)",
    )
    shutdown_grace_s: float = _opt(30.0, "on SIGTERM, seconds to let in-flight requests finish")


@dataclass
class Routing:
    """How a request is tokenized, hashed and placed (router/schedule/)."""

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
    lazy_tail: bool = _opt(
        True,
        "route on a prompt's head and tokenize the rest off the critical path where the "
        "decision is provably the same (router/routing/lazy_tail.py)",
    )
    decision_headers: bool | None = _opt(
        None,
        "add x-prefix-router-replica and x-prefix-router-cached-blocks to responses (default: "
        "on with auth off, off with auth on; with auth on the replica is named replica-<n>, "
        "never by its URL)",
    )


@dataclass
class Health:
    """Active health checks, metric scrapes and outlier ejection (router/fleet/outlier.py)."""

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


@dataclass
class Forwarding:
    """The upstream proxy: timeouts, retries, forwarded headers (router/upstream/proxy.py)."""

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
    retry_budget_percent: float = _opt(
        20.0,
        "at most this percentage of the requests in flight may be on a retry at once (Envoy's "
        "retry budget); a request past it that may have reached its replica gets a 503",
    )
    retry_budget_min_concurrency: int = _opt(
        3, "retries allowed at once however few requests are in flight"
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


@dataclass
class Limits:
    """Client connections and request bodies, bounded before any work (router/intake/shapes.py, router/http/connections.py)."""

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
        "the fraction of max_inflight_body_bytes, max_held_body_bytes and max_connections one "
        "client may hold (a tenant with auth on, else a peer address; 1: no per-client bound)",
    )
    max_held_body_bytes: int = _opt(
        1024 * 1024 * 1024,
        "request bodies the gateway may hold at once once they arrived (queued, or being "
        "forwarded), each charged twice its decoded size; beyond a client's client_share of "
        "it a 429, beyond it all a 503",
    )
    max_prompt_chars: int = _opt(4_000_000, "largest rendered prompt, in characters")
    max_tokenize_cpu_s: float = _opt(
        2.0,
        "CPU seconds one request's new (uncached) prompt text may take to tokenize; beyond "
        "it the request is refused with a 413 (raise it for very long contexts)",
    )
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
    peer_refusals_per_s: float = _opt(
        10.0,
        "connections beyond a peer's share answered per second (a 503, probes answered); its "
        "other ones are closed as they are accepted, unread (a reconnect flood costs little)",
    )
    max_json_depth: int = _opt(64, "deepest JSON nesting accepted inside any field of a body")
    max_json_nodes: int = _opt(1_000_000, "most JSON values (objects, arrays, scalars) in a body")
    max_string_chars: int = _opt(8 * 1024 * 1024, "longest JSON string (or key) in a body")
    max_messages: int = _opt(20_000, "most messages in a chat request")
    max_content_parts: int = _opt(1_024, "most content parts in one message")
    max_tools: int = _opt(512, "most tools in a request (or in one message)")
    max_template_kwargs: int = _opt(256, "most keys in chat_template_kwargs")


@dataclass
class Fleet:
    """Fleet mode: gateways sharing the prefix map, ring and load through Redis."""

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
    redis_layout: str = _opt(
        "map",
        "the shared index's layout in Redis: 'map' (one hash per model: a lookup is one "
        "command, writes batched) or 'zsets' (a sorted set per replica, written per request)",
    )
    redis_flush_ms: float = _opt(
        100.0,
        "the map layout sends this gateway's index writes at most this many ms after the "
        "first one queued (or once 512 are queued): what other gateways see is this late",
    )


@dataclass
class KvEvents:
    """Precise mode: vLLM KV cache events keep the index exact (router/kv_events/)."""

    enabled: bool = _opt(
        False,
        "subscribe to each replica's vLLM KV cache events (ZMQ) and keep the index exact "
        "from them; a replica whose events stop is routed on the approximate model",
        flat="kv_events",
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
    kv_events_offload_weight: float = _opt(
        0.8,
        "what a block only a replica's offload tier (medium CPU, STORAGE) holds is worth next "
        "to a GPU block, 0..1: vLLM loads it over the host link instead of computing it",
    )


@dataclass
class Discovery:
    """The replicas: listed, and found by DNS (router/fleet/discovery.py)."""

    replicas: list[str] = _opt(
        [], "a vLLM replica base URL, e.g. http://10.0.0.1:8000 (repeatable)"
    )
    discovery_dns: str | None = _opt(
        None, "discover replicas by resolving this DNS name (e.g. a headless Service) periodically"
    )
    discovery_port: int = _opt(8000, "port of replicas found by DNS discovery")
    discovery_interval_s: float = _opt(10.0, "seconds between DNS discovery lookups")


@dataclass
class Auth:
    """Tenancy: API keys, cache salts, per-tenant settings, the admin key (router/tenancy/tenants.py)."""

    enabled: bool = _opt(
        False, "require Authorization: Bearer <key> (keys from api_keys_file)", flat="auth"
    )
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
    public_prefixes: dict[str, Any] = _opt(
        {}, "named public prefixes (config file only)", flag=False
    )
    admin_key: str | None = _opt(
        None, "key for admin endpoints (/admin/*, /v1/route/explain)", secret=True
    )
    admin_networks: list[str] = _opt(
        ["127.0.0.0/8", "::1/128"],
        "with no admin_key, /v1/route/explain answers only clients from these networks "
        "(default: loopback; empty: off)",
    )

    @property
    def tenanted(self) -> bool:
        """Requests carry a tenant: API keys, or a header that names it."""
        return self.enabled or self.tenant_header is not None


@dataclass
class Registry:
    """The served models: tokenizers, templates, aliases, adapters (router/models/; docs/models.md)."""

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
    lora_refusal_ttl_s: float = _opt(
        60.0,
        "a replica that refused to load a LoRA adapter (a 4xx: bad path, runtime updates off) "
        "is not asked again for that adapter for this long; its requests get a 404",
    )
    tokenizer_download: bool = _opt(
        False,
        "at start-up, fetch the tokenizer files of a served model whose tokenizer is not on "
        "this host from HF_ENDPOINT (default the Hugging Face Hub) into the local Hugging Face "
        "cache; never on a request's path; HF_HUB_OFFLINE wins (docs/models.md)",
    )
    parity_probe: bool = _opt(
        True,
        "at start-up and when a model's replicas change, tokenize a fixed set of probe "
        "requests here and through each replica's /tokenize; a model whose ids differ is "
        "routed by its text prefix until they agree (docs/models.md)",
    )


@dataclass
class Flow:
    """Flow control: fair queuing per tenant while replicas are saturated (router/flow/)."""

    enabled: bool | None = _opt(
        None,
        "while a model's replicas are saturated, queue requests in the gateway and release "
        "them in weighted fair order per tenant (weights, bands, rate limits in the tenancy "
        "table; docs/flow-control.md). Default: on when requests carry a tenant (auth on or "
        "a tenant_header), off otherwise (all traffic is one tenant)",
        flat="flow_control",
    )
    flow_prefill_per_replica: float = _opt(
        1.0,
        "requests in prefill (sent, no first byte yet) each replica may have before requests "
        "wait in the gateway: vLLM's own queue cannot be reordered",
    )
    flow_step_tokens: int = _opt(
        2048,
        "vLLM's --max-num-batched-tokens on the replicas (its default: 2048; 8192 on GPUs of "
        "70 GB or more other than A100): while one tenant is alone, a replica takes released "
        "requests until this many uncached prompt tokens are in prefill there, as one vLLM "
        "step would take them",
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
    flow_burst_tokens: float = _opt(
        4096.0,
        "work (tokens per unit weight) a tenant that used less than its share may send ahead "
        "of busier tenants when it queues again, so its bursts do not wait behind a flood",
    )
    flow_band_priority: bool = _opt(
        False,
        "set each request's vLLM priority from its tenant's band (critical -1, standard 0, "
        "sheddable 1): only for replicas started with --scheduling-policy priority, which "
        "refuse a non-zero priority otherwise",
    )
