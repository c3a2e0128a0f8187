"""``LiveDiagnostics``: a gateway observer that feeds every finished request into a window,
keeps the window's hit-rate gauges (ideal, and the three reuse numbers: available, captured,
delivered), and answers reports on demand."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from router.ops.diagnose.analysis import Sample, tool_names
from router.ops.diagnose.render import render_text
from router.ops.diagnose.window import Window

if TYPE_CHECKING:
    from router.gateway import Gateway
    from router.intake.routed_request import RoutedRequest
    from router.schedule import Decision
    from router.upstream.proxy import Outcome

log = logging.getLogger("prefix_router.diagnose")


class LiveDiagnostics:
    """Watches every finished request (``observe``) and answers ``report`` on demand."""

    def __init__(
        self,
        gateway: Gateway,
        window: Window | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        gauge_interval_s: float = 1.0,
        counter_interval_s: float = 1.0,
    ) -> None:
        from prometheus_client import Gauge

        self.gateway = gateway
        self.clock = clock
        self.window = window or Window(clock=clock)
        self.gauge_interval_s = gauge_interval_s
        self.counter_interval_s = counter_interval_s
        reg = gateway.metrics.registry
        self.ideal_gauge = Gauge(
            "prefix_router_ideal_hit_rate",
            "Prefix-cache hit rate one unlimited cache would reach on the diagnostics window",
            ["model"],
            registry=reg,
        )
        self.available_gauge = Gauge(
            "prefix_router_available_hit_rate",
            "Reuse available: the longest prefix any replica held, per prompt token (window)",
            ["model"],
            registry=reg,
        )
        self.captured_gauge = Gauge(
            "prefix_router_captured_hit_rate",
            "Reuse captured: what the chosen replica held, per prompt token (window)",
            ["model"],
            registry=reg,
        )
        self.delivered_gauge = Gauge(
            "prefix_router_delivered_hit_rate",
            "Reuse delivered: the replicas' reported cached tokens, per prompt token (window)",
            ["model"],
            registry=reg,
        )
        # The names the dashboard read before the three numbers had names of their own
        # (deploy/grafana/prefix-router.json as imported by existing deployments): the same
        # values as captured and delivered.
        self.predicted_gauge = Gauge(
            "prefix_router_predicted_hit_rate",
            "Deprecated: prefix_router_captured_hit_rate",
            ["model"],
            registry=reg,
        )
        self.measured_gauge = Gauge(
            "prefix_router_measured_hit_rate",
            "Deprecated: prefix_router_delivered_hit_rate",
            ["model"],
            registry=reg,
        )
        self._gauges_at: dict[str, float] = {}
        self._snaps: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()
        self.errors = 0

    def observe(self, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
        try:
            if outcome.status >= 400:
                return
            now = self.clock()
            tools = tool_names(rr.body) if rr.endpoint == "chat" else None
            bs = rr.block_size
            most = max((s.matched_blocks for s in decision.scores), default=None)
            self.window.add(
                Sample(
                    token_ids=rr.token_ids,
                    block_size=bs,
                    model=rr.model,
                    tenant=rr.tenant,
                    app=rr.app_label,
                    block_hashes=rr.block_hashes,
                    cache_salt=rr.cache_salt,
                    lora=rr.lora,
                    replica=decision.replica,
                    captured_tokens=decision.matched_blocks * bs,
                    available_tokens=None if most is None else most * bs,
                    cached_tokens=outcome.cached_tokens,
                    completion_tokens=outcome.completion_tokens,
                    max_tokens=rr.max_tokens,
                    tools=tools,
                ),
                now,
            )
            self._snapshot(now)
            if now - self._gauges_at.get(rr.model, -math.inf) >= self.gauge_interval_s:
                self._gauges_at[rr.model] = now
                self.update_gauges(rr.model)
        except Exception:  # never let diagnostics break the request path
            self.errors += 1
            log.debug("diagnostics observe failed", exc_info=True)

    def update_gauges(self, model: str | None = None) -> None:
        for m, acc in self.window.sums.items():
            if model is not None and m != model:
                continue
            n, ideal, pn, available, captured, dn, delivered = acc
            if n:
                self.ideal_gauge.labels(m).set(ideal / n)
            if pn:
                self.available_gauge.labels(m).set(available / pn)
                self.captured_gauge.labels(m).set(captured / pn)
                self.predicted_gauge.labels(m).set(captured / pn)
            if dn:
                self.delivered_gauge.labels(m).set(delivered / dn)
                self.measured_gauge.labels(m).set(delivered / dn)

    def _counters_now(self) -> dict[str, tuple[float, float]]:
        fleet = self.gateway.fleet
        if fleet is None:
            return {}
        return {u: (r.stats.prefix_hits, r.stats.prefix_queries) for u, r in fleet.replicas.items()}

    def _snapshot(self, now: float) -> None:
        snaps = self._snaps
        if snaps and now - snaps[-1][0] < self.counter_interval_s:
            return
        snaps.append((now, self._counters_now()))
        horizon = now - self.window.max_age_s
        while len(snaps) > 2 and snaps[1][0] <= horizon:
            snaps.popleft()

    def counter_deltas(self) -> dict[str, tuple[float, float]]:
        """The replicas' ``vllm:prefix_cache_hits/queries_total`` deltas over the window."""
        if not self._snaps:
            return {}
        base = self._snaps[0][1]
        out = {}
        for url, (h, q) in self._counters_now().items():
            h0, q0 = base.get(url, (0.0, 0.0))
            if h < h0 or q < q0:  # the replica restarted: its counters began again
                h0 = q0 = 0.0
            out[url] = (h - h0, q - q0)
        return {u: v for u, v in out.items() if v[1] > 0}

    def report(
        self,
        model: str | None = None,
        tenant: str | None = None,
        app: str | None = None,
        redact: bool = False,
    ) -> dict[str, Any]:
        rep = self.window.report(
            model,
            tenant,
            app,
            redact=redact,
            decode=self.gateway.decoder,  # each model's ids with its own tokenizer
            counters=self.counter_deltas(),
        )
        self.update_gauges()
        return rep

    def render(self, **kwargs: Any) -> str:
        return render_text(self.report(**kwargs))


def attach(gateway: Gateway) -> LiveDiagnostics:
    """The gateway's diagnostics observer: the one among ``gateway.observers``, else a new one
    appended there (it sees requests from then on)."""
    for observer in gateway.observers:
        if isinstance(observer, LiveDiagnostics):
            return observer
    diag = LiveDiagnostics(gateway)
    gateway.watch(diag)
    return diag
