"""The configuration's value checks: every problem at once, one sentence each."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from router.core.redis_client import parse_redis_url
from router.schedule import ScheduleError, check_config, policy_names

if TYPE_CHECKING:
    from router.config.composed import Config


def disaggregation_problems(config: Config) -> list[str]:
    """The P/D settings: known policies, sensible thresholds, each replica in one role."""
    out = []
    pd = config.disaggregation
    for name in ("pd_prefill_policy", "pd_decode_policy"):
        value = config.get(name)
        if value is not None and value not in policy_names():
            out.append(f"{name} must be one of {', '.join(policy_names())}, got {value!r}")
    if pd.pd_order not in ("decode-first", "prefill-first"):
        out.append(f"pd_order must be decode-first or prefill-first, got {pd.pd_order!r}")
    if min(pd.pd_min_prompt_tokens, pd.pd_min_uncached_tokens) < 0:
        out.append("pd_min_prompt_tokens and pd_min_uncached_tokens must be >= 0")
    roles: dict[str, str] = {}
    for role, urls in (
        ("replica", config.discovery.replicas),
        ("prefill_replica", pd.prefill_replicas),
        ("decode_replica", pd.decode_replicas),
    ):
        for url in urls:
            key = url.rstrip("/")
            if key in roles and roles[key] != role:
                out.append(f"{url} is listed as both {roles[key]} and {role}: give it one role")
            roles.setdefault(key, role)
    decoders = pd.decode_replicas or pd.pd_decode_dns or config.discovery.replicas
    if (pd.prefill_replicas or pd.pd_prefill_dns) and not (
        decoders or config.discovery.discovery_dns
    ):
        out.append("prefill_replica needs a decode_replica (or a replica) to decode")
    return out


def problems(config: Config) -> list[str]:
    """Every problem with this config's values, one sentence each."""
    problems: list[str] = []
    if not 0 < config.server.port < 65536:
        problems.append(f"port must be 1..65535, got {config.server.port}")
    if config.server.metrics_port is not None and not (
        0 < config.server.metrics_port < 65536 and config.server.metrics_port != config.server.port
    ):
        problems.append(
            f"metrics_port must be 1..65535 and differ from port, got {config.server.metrics_port}"
        )
    ext_proc = config.server.ext_proc_port
    if ext_proc is not None and not (
        0 <= ext_proc < 65536 and ext_proc not in (config.server.port, config.server.metrics_port)
    ):
        problems.append(
            f"ext_proc_port must be 0..65535 and differ from port and metrics_port, got {ext_proc}"
        )
    if not 0 <= config.server.ext_proc_fallbacks <= 8:
        problems.append(f"ext_proc_fallbacks must be 0..8, got {config.server.ext_proc_fallbacks}")
    if config.routing.block_size is not None and config.routing.block_size <= 0:
        problems.append(f"block_size must be positive, got {config.routing.block_size}")
    from router.intake.held import HELD_FACTOR
    from router.models.spec import ModelSpecError, alias_map, parse_models

    try:
        alias_map(parse_models(config.registry.models), config.registry.model_aliases)
    except ModelSpecError as e:
        problems.append(str(e))
    if config.limits.body_timeout_s <= 0:
        problems.append(f"body_timeout_s must be positive, got {config.limits.body_timeout_s}")
    if config.limits.max_held_body_bytes < HELD_FACTOR * config.limits.max_body_bytes:
        problems.append(
            f"max_held_body_bytes ({config.limits.max_held_body_bytes}) must be at least "
            f"{HELD_FACTOR:g} x max_body_bytes ({config.limits.max_body_bytes}): a body is "
            "charged that much while it is held"
        )
    if config.limits.max_inflight_body_bytes < config.limits.max_body_bytes:
        problems.append(
            f"max_inflight_body_bytes ({config.limits.max_inflight_body_bytes}) must be at least "
            f"max_body_bytes ({config.limits.max_body_bytes})"
        )
    if not 0 < config.limits.client_share <= 1:
        problems.append(f"client_share must be in (0, 1], got {config.limits.client_share}")
    for net in config.auth.admin_networks:
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
        if config.get(name) < 1:
            problems.append(f"{name} must be >= 1, got {config.get(name)}")
    if config.server.workers < 1:
        problems.append(f"workers must be >= 1, got {config.server.workers}")
    if config.routing.load_bound < 1.0:
        problems.append(f"load_bound must be >= 1.0, got {config.routing.load_bound}")
    if config.server.log_level.lower() not in ("debug", "info", "warning", "error"):
        problems.append(
            f"log_level must be debug, info, warning or error, got {config.server.log_level!r}"
        )
    listed = config.discovery.replicas + config.disaggregation.prefill_replicas
    listed = listed + config.disaggregation.decode_replicas
    for url in listed:
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
        "peer_refusals_per_s",
        "max_tokenize_cpu_s",
    )
    for name in positive:
        if not config.get(name) > 0:
            problems.append(f"{name} must be positive, got {config.get(name)}")
    if config.health.eject_after_failures < 1 or config.health.outlier_min_requests < 1:
        problems.append("eject_after_failures and outlier_min_requests must be >= 1")
    if not 0 < config.health.outlier_error_ratio < 1:
        problems.append(
            f"outlier_error_ratio must be between 0 and 1, got {config.health.outlier_error_ratio}"
        )
    if not 0 <= config.health.max_ejected_percent <= 100:
        problems.append(
            f"max_ejected_percent must be 0..100, got {config.health.max_ejected_percent}"
        )
    if config.forwarding.first_byte_timeout_factor < 1:
        problems.append(
            f"first_byte_timeout_factor must be >= 1, got {config.forwarding.first_byte_timeout_factor}"
        )
    if not 0 < config.kv_events.kv_events_port < 65536 or (
        config.kv_events.kv_events_replay_port is not None
        and not 0 < config.kv_events.kv_events_replay_port < 65536
    ):
        problems.append("kv_events_port and kv_events_replay_port must be 1..65535")
    if config.fleet.redis_refresh_blocks < 0:
        problems.append(
            f"redis_refresh_blocks must be >= 0 (0: every block), got {config.fleet.redis_refresh_blocks}"
        )
    if not 0.0 <= config.kv_events.kv_events_offload_weight <= 1.0:
        problems.append(
            "kv_events_offload_weight must be 0..1 (a GPU block is 1), got "
            f"{config.kv_events.kv_events_offload_weight}"
        )
    if config.fleet.redis_layout not in ("map", "zsets"):
        problems.append(f"redis_layout must be 'map' or 'zsets', got {config.fleet.redis_layout!r}")
    if config.fleet.redis_flush_ms <= 0:
        problems.append(f"redis_flush_ms must be positive, got {config.fleet.redis_flush_ms}")
    if config.kv_events.kv_events_timeout_s <= 0:
        problems.append(
            f"kv_events_timeout_s must be positive, got {config.kv_events.kv_events_timeout_s}"
        )
    for url, ep in config.kv_events.kv_events_endpoints.items():
        given = ep.get("endpoint") if isinstance(ep, dict) else ep
        if not isinstance(given, str) or not given.startswith(("tcp://", "ipc://")):
            problems.append(
                f"kv_events_endpoints[{url!r}] must be tcp://host:port (or a mapping with "
                "endpoint and replay_endpoint)"
            )
    for url in listed:
        if url.rstrip("/").endswith("/v1"):
            problems.append(
                f"replica URL {url!r} ends in /v1: give vLLM's base URL "
                f"({url.rstrip('/').removesuffix('/v1')}); the gateway adds the paths"
            )
    if config.fleet.redis_url:
        try:
            parse_redis_url(config.fleet.redis_url)  # one server, a cluster or a sentinel's
        except ValueError as exc:
            problems.append(str(exc))
    f = config.flow
    if f.flow_prefill_per_replica <= 0 or f.flow_queue_timeout_s <= 0 or f.flow_step_tokens <= 0:
        problems.append(
            "flow_prefill_per_replica, flow_queue_timeout_s and flow_step_tokens must be positive"
        )
    if (
        min(
            config.flow.flow_max_queue,
            config.flow.flow_max_queue_per_tenant,
            config.flow.flow_waiting_max,
        )
        < 1
    ):
        problems.append(
            "flow_max_queue, flow_max_queue_per_tenant and flow_waiting_max must be >= 1"
        )
    if not 0 < config.flow.flow_kv_usage_max <= 1 or config.flow.flow_ttft_max_s < 0:
        problems.append("flow_kv_usage_max must be in (0, 1] and flow_ttft_max_s >= 0")
    f = config.flow
    if min(f.flow_decode_token_cost, f.flow_history_tokens, f.flow_burst_tokens) < 0:
        problems.append(
            "flow_decode_token_cost, flow_history_tokens and flow_burst_tokens must be >= 0"
        )
    fw = config.forwarding
    if not 0 <= fw.retry_budget_percent <= 100 or fw.retry_budget_min_concurrency < 0:
        problems.append(
            "retry_budget_percent must be in [0, 100] and retry_budget_min_concurrency >= 0"
        )
    if config.registry.lora_refusal_ttl_s < 0:
        problems.append(
            f"lora_refusal_ttl_s must be >= 0, got {config.registry.lora_refusal_ttl_s}"
        )
    try:
        check_config(config.routing)
    except ScheduleError as e:
        problems.append(str(e))
    problems.extend(disaggregation_problems(config))
    return problems
