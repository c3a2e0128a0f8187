"""The gateway's Prometheus metrics, all named ``prefix_router_*``, in one registry per app."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from router import __version__
from router.telemetry.loop_metrics import LoopCounter, LoopFamily, LoopGauge, LoopHistogram, S

M = TypeVar("M", bound=MetricWrapperBase)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from router.schedule import Decision

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# The request path's own series are loop families (router/telemetry/loop_metrics.py).


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        build = Gauge(
            "prefix_router_build_info",
            "Always 1; the labels say which prefix-router and Python this gateway runs",
            ["version", "python"],
            registry=r,
        )
        build.labels(__version__, platform.python_version()).set(1)
        # (metric, label values) -> child: prometheus_client's labels() validates and locks
        # on every call (~1.2 us, several per request); children are never removed here.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._reuse: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        self.requests = LoopCounter(
            "prefix_router_requests",
            "Requests by replica, policy and outcome",
            ["replica", "policy", "outcome"],
            registry=r,
        )
        self.decisions = LoopCounter(
            "prefix_router_decisions",
            "Routing decisions by reason",
            ["policy", "reason"],
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "prefix_router_prompt_tokens", "Prompt tokens routed", ["tenant"], registry=r
        )
        # The three reuse numbers, per model and tenant (router/routing/reuse.py).
        self.reuse_prompt_tokens = LoopCounter(
            "prefix_router_reuse_prompt_tokens",
            "Prompt tokens of answered requests: the reuse numbers' denominator",
            ["model", "tenant"],
            registry=r,
        )
        self.reuse_available_tokens = LoopCounter(
            "prefix_router_reuse_available_tokens",
            "Reuse available: prompt tokens the replica holding the longest prefix held",
            ["model", "tenant"],
            registry=r,
        )
        self.reuse_captured_tokens = LoopCounter(
            "prefix_router_reuse_captured_tokens",
            "Reuse captured: prompt tokens the chosen replica held (the gateway's prediction)",
            ["model", "tenant"],
            registry=r,
        )
        self.reuse_delivered_tokens = LoopCounter(
            "prefix_router_reuse_delivered_tokens",
            "Reuse delivered: cached prompt tokens the replica reported "
            "(usage.prompt_tokens_details.cached_tokens)",
            ["model", "tenant"],
            registry=r,
        )
        # Before the three numbers: captured and delivered by tenant, every attempt. Kept
        # because dashboards imported from deploy/grafana/prefix-router.json read them.
        self.predicted_cached_tokens = LoopCounter(
            "prefix_router_predicted_cached_tokens",
            "Prompt tokens the gateway predicted the chosen replica holds (see "
            "prefix_router_reuse_captured_tokens)",
            ["tenant"],
            registry=r,
        )
        self.reported_cached_tokens = LoopCounter(
            "prefix_router_reported_cached_tokens",
            "Cached prompt tokens the replicas reported, usage.prompt_tokens_details (see "
            "prefix_router_reuse_delivered_tokens)",
            ["tenant"],
            registry=r,
        )
        self.tenant_requests = LoopCounter(
            "prefix_router_tenant_requests", "Requests by tenant", ["tenant"], registry=r
        )
        self.front_end_requests = LoopCounter(
            "prefix_router_front_end_requests",
            "Routed requests by the front end they came through: http (proxy mode) or "
            "ext_proc (endpoint picker mode, router/ext_proc/); every other series counts both",
            ["front_end"],
            registry=r,
        )
        self.ext_proc_refusals = LoopCounter(
            "prefix_router_ext_proc_refusals",
            "Endpoint picker mode: requests answered with an ext_proc immediate response",
            ["status"],
            registry=r,
        )
        # -- per served model (router/models/)
        self.model_info = Gauge(
            "prefix_router_model_info",
            "Served models: how requests are matched (basis tokens, or text_prefix without a "
            "tokenizer), where the tokenizer came from, the block size",
            ["model", "basis", "tokenizer", "block_size"],
            registry=r,
        )
        self.model_requests = LoopCounter(
            "prefix_router_model_requests",
            "Requests by served model and basis (tokens, or text_prefix: no tokenizer)",
            ["model", "basis"],
            registry=r,
        )
        self.model_predicted_cached_tokens = LoopCounter(
            "prefix_router_model_predicted_cached_tokens",
            "Prompt tokens predicted held by the chosen replica, by model",
            ["model"],
            registry=r,
        )
        self.model_reported_cached_tokens = LoopCounter(
            "prefix_router_model_reported_cached_tokens",
            "Cached prompt tokens the replicas reported, by model",
            ["model"],
            registry=r,
        )
        self.model_drift = LoopGauge(
            "prefix_router_model_drift",
            "Share of a model's recently predicted cached tokens its replicas did not confirm",
            ["model"],
            registry=r,
        )
        self.model_drifting = LoopGauge(
            "prefix_router_model_drifting",
            "1 while a model's predictions run consistently above what its replicas report",
            ["model"],
            registry=r,
        )
        self.model_parity_mismatch = Gauge(
            "prefix_router_model_parity_mismatch",
            "1 while the parity probe finds a model's replicas tokenizing its probe requests "
            "otherwise than the gateway (the model is routed by its text prefix)",
            ["model"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "prefix_router_lora_adapter_loads",
            "LoRA adapters loaded on a replica at run time (/v1/load_lora_adapter), by outcome",
            ["model", "adapter", "outcome"],
            registry=r,
        )
        self.prediction_error = LoopHistogram(
            "prefix_router_prediction_error_tokens",
            "predicted - reported cached tokens, for responses that report them",
            buckets=(-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096),
            registry=r,
        )
        self.decision_latency = LoopHistogram(
            "prefix_router_decision_seconds",
            "Index lookup + policy decision time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize_latency = LoopHistogram(
            "prefix_router_tokenize_seconds",
            "Rendering + tokenization + hashing time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_ttft = LoopHistogram(
            "prefix_router_upstream_ttft_seconds",
            "Time from forwarding to the first response byte",
            ["replica"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inflight = LoopGauge(
            "prefix_router_inflight_requests",
            "Requests in flight per replica",
            ["replica"],
            registry=r,
        )
        self.lazy_tail = LoopCounter(
            "prefix_router_lazy_tail_decisions",
            "Decisions on a prompt's head with its tail tokenized after (on=head), or that "
            "had to wait for the whole prompt because a match reached the head's end (on=full)",
            ["on"],
            registry=r,
        )
        self.retries = LoopCounter(
            "prefix_router_retries",
            "Requests retried on another replica before the first byte",
            ["replica", "why"],
            registry=r,
        )
        self.retries_shed = LoopCounter(
            "prefix_router_retries_shed",
            "Requests that failed before the first byte and were not re-sent: every replica "
            "saturated after a timeout (reason=saturated), or retries at their budget "
            "(reason=budget)",
            ["reason"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            "prefix_router_replica_healthy",
            "1 if the replica is in rotation",
            ["replica"],
            registry=r,
        )
        self.ejections = Counter(
            "prefix_router_replica_ejections",
            "Replicas taken out of rotation by outlier detection, by reason "
            "(consecutive_failures, error_ratio)",
            ["replica", "reason"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "prefix_router_index_blocks",
            "Blocks the index models per replica",
            ["replica"],
            registry=r,
        )
        self._redis_up: Gauge | None = None
        self.kv_events_up = Gauge(
            "prefix_router_kv_events_up",
            "1 while the replica's KV cache events keep its index exact (precise mode), 0 "
            "while it is routed on the approximate model",
            ["replica"],
            registry=r,
        )
        self.kv_events_errors = Counter(
            "prefix_router_kv_events_errors",
            "KV event messages or events not applied, by reason",
            ["replica", "reason"],
            registry=r,
        )
        self.kv_event_stream_owned = Gauge(
            "prefix_router_kv_event_stream_owned",
            "1 while this gateway writes the replica's KV events to the shared index (fleet "
            "mode: one gateway per stream holds its lease; without Redis, always 1)",
            ["replica"],
            registry=r,
        )
        self.kv_events_retracted = Counter(
            "prefix_router_kv_events_retracted_blocks",
            "Blocks this gateway recorded for placements that the replica's KV events never "
            "stored (a failed request, a record after the block's eviction), retracted",
            ["replica"],
            registry=r,
        )
        self.rewritten_ids = Counter(
            "prefix_router_upstream_rewritten_request_ids",
            "Answers whose X-Request-Id the gateway never sent on that connection (a hop "
            "between gateway and replica sets its own ids): accepted",
            ["replica"],
            registry=r,
        )
        self.redis_fallbacks = Counter(
            "prefix_router_redis_fallbacks", "Lookups answered from the local view", registry=r
        )
        self.client_disconnects = Counter(
            "prefix_router_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.rejected = Counter(
            "prefix_router_rejected_requests",
            "Requests refused before routing to protect the gateway, by reason "
            "(body_timeout, inflight_bytes, client_inflight_bytes, held_bytes, "
            "client_held_bytes, json_check, connections, peer_connections, header_timeout)",
            ["reason"],
            registry=r,
        )
        self.json_checks = Counter(
            "prefix_router_json_checks",
            "Request bodies whose parse could hold the event loop, parsed and held to the "
            "limits in a child process first, by outcome (passed, refused, broken: the child died)",
            ["outcome"],
            registry=r,
        )

        # Spills: a fixed set of causes (the pickers' labels and the filter names), so the
        # label cardinality is bounded; the replica set is a histogram, not a gauge per prefix.
        self.spills = LoopCounter(
            "prefix_router_spills",
            "Requests placed away from the longest prefix holder, by policy and cause",
            ["policy", "cause"],
            registry=r,
        )
        self.spill_evictions = LoopCounter(
            "prefix_router_spill_evicted_blocks_estimated",
            "Blocks spills copied to their replica (estimated evictions: once a cache has "
            "filled, each block written evicts one cached block)",
            ["policy"],
            registry=r,
        )
        self.prefix_holders = LoopHistogram(
            "prefix_router_prefix_replicas",
            "Replicas holding a routed prompt's first block (its prefix's replica set), per "
            "request that reuses one",
            ["policy"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )

    def placed(self, d: Decision) -> None:
        """A decision was acted on: its reason, and for a spill its cause and copy."""
        self.child(self.decisions, d.policy, d.reason).inc()
        if d.holders:
            self.child(self.prefix_holders, d.policy).observe(d.holders)
        if d.cause is not None:
            self.child(self.spills, d.policy, d.cause).inc()
            self.child(self.spill_evictions, d.policy).inc(d.copied_blocks)

    def exposition(self) -> bytes:
        """The /metrics page, without the ``*_created`` series (one per counter and histogram
        child, which nobody graphs). prometheus_client's ``disable_created_metrics`` would do
        it for the whole process, simulated replicas included; this leaves them alone."""
        return generate_latest(_WithoutCreated(self.registry))

    @overload
    def child(self, metric: LoopFamily[S], *values: str) -> S: ...

    @overload
    def child(self, metric: M, *values: str) -> M: ...

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, memoised: the hot path's way to a labelled series."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def reuse_series(self, model: str, tenant: str) -> tuple[Any, Any, Any, Any]:
        """The four reuse series of ``model`` and ``tenant`` (prompt, available, captured,
        delivered), memoised together: one lookup a request instead of four."""
        key = (model, tenant)
        found = self._reuse.get(key)
        if found is None:
            found = self._reuse[key] = (
                self.reuse_prompt_tokens.labels(model, tenant),
                self.reuse_available_tokens.labels(model, tenant),
                self.reuse_captured_tokens.labels(model, tenant),
                self.reuse_delivered_tokens.labels(model, tenant),
            )
        return found

    @property
    def redis_up(self) -> Gauge:
        """Registered on first use (when fleet mode starts), so a gateway with no Redis
        configured exports no ``prefix_router_redis_up``: a 0 there would read as an outage."""
        if self._redis_up is None:
            self._redis_up = Gauge(
                "prefix_router_redis_up",
                "1 when shared state in Redis is in use (fleet mode)",
                registry=self.registry,
            )
        return self._redis_up


class _WithoutCreated:
    """A registry's families with their ``*_created`` samples left out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
