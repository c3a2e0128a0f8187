"""Flow control's Prometheus metrics (docs/flow-control.md lists them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.depth = Gauge(
            "prefix_router_flow_queue_depth",
            "Requests waiting in the gateway's flow-control queue, by band",
            ["band"],
            registry=r,
        )
        self.wait = Histogram(
            "prefix_router_flow_queue_wait_seconds",
            "Time queued requests waited before release, by band",
            ["band"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.released = Counter(
            "prefix_router_flow_released",
            "Requests released to the scheduler, by band and whether they waited",
            ["band", "waited"],
            registry=r,
        )
        self.shed = Counter(
            "prefix_router_flow_shed",
            "Requests refused with a 429 by flow control, by tenant and reason (queue_full, "
            "overflow, queue_timeout, rate_requests, rate_tokens)",
            ["tenant", "reason"],
            registry=r,
        )
        self.in_prefill = Gauge(
            "prefix_router_flow_in_prefill",
            "Requests this gateway released that have not had their first byte yet",
            registry=r,
        )
        self.saturated = Gauge(
            "prefix_router_flow_saturated",
            "1 while some model's replicas have no free prefill slot (requests queue)",
            registry=r,
        )
        self.remote_usage = Counter(
            "prefix_router_flow_remote_usage_tokens",
            "Work (tokens) other gateways reported for a tenant through Redis (fleet mode)",
            ["tenant"],
            registry=r,
        )
