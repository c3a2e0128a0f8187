"""What disaggregation tells the operator: metrics per role, and the misconfigurations that
would otherwise pass silently, each a loud warning (once per replica and kind), a metric and
a line in ``/ready``'s detail for the admin.

- a prefill replica that answers without ``kv_transfer_params``: started without a KV
  connector (``--kv-transfer-config``), so every decode replica recomputes every prompt (an
  llm-d deployment served decode-only for weeks this way); the request is still served;
- a prefill replica whose side channel names a loopback host while the gateway reaches it at
  another: vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (localhost), so decode replicas on
  other hosts cannot pull from it.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from router.telemetry.metrics import LoopCounter

log = logging.getLogger("prefix_router")

NO_TRANSFER_PARAMS = "no_transfer_params"
LOOPBACK_SIDE_CHANNEL = "loopback_side_channel"
PROBLEMS = {
    NO_TRANSFER_PARAMS: (
        "prefill replica %s answered a prefill leg without kv_transfer_params: it has no KV "
        'connector (start vLLM with --kv-transfer-config \'{"kv_connector":"NixlConnector",'
        '"kv_role":"kv_both"}\'); requests are served without disaggregation meanwhile'
    ),
    LOOPBACK_SIDE_CHANNEL: (
        "prefill replica %s names remote_host %r for its NIXL side channel while the gateway "
        "reaches it at another host: set VLLM_NIXL_SIDE_CHANNEL_HOST to an address decode "
        "replicas can reach"
    ),
}


class PdWatch:
    """Per-role counters and the problems seen, by replica."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.legs = LoopCounter(
            "prefix_router_pd_legs",
            "Legs of disaggregated requests sent, by role (prefill, decode)",
            ["role"],
            registry=registry,
        )
        self.skipped = LoopCounter(
            "prefix_router_pd_prefill_skipped",
            "Requests served on a decode replica without a prefill leg, by reason "
            "(short_prompt, cached_on_decode, several_sequences, no_prefill_replica, "
            "stored_response, client_transfer_params)",
            ["reason"],
            registry=registry,
        )
        self.fallbacks = LoopCounter(
            "prefix_router_pd_fallbacks",
            "Disaggregated requests re-planned, by reason (prefill_failed: another prefill "
            "replica or aggregated; decode_failed: the prefill leg run again for another "
            "decode replica; no_transfer_params: served aggregated on the decode replica; "
            "prefill_http_4xx: the prefill replica refused the request, the decode replica "
            "answers it whole; pull_failed: the decode replica could not pull (a 500), "
            "planned again without that prefill replica)",
            ["reason"],
            registry=registry,
        )
        self.pulled_blocks = LoopCounter(
            "prefix_router_pd_pulled_blocks",
            "KV blocks decode replicas were predicted to pull (the prompt's blocks they lacked)",
            registry=registry,
        )
        self.fewest_pulled = LoopCounter(
            "prefix_router_pd_fewest_pulled_blocks",
            "KV blocks the decode replica lacking the fewest would have pulled (the minimum "
            "the decode choice is measured against)",
            registry=registry,
        )
        self.problems_total = LoopCounter(
            "prefix_router_pd_misconfigured",
            "Prefill answers showing a fleet misconfigured for P/D, by kind "
            "(no_transfer_params, loopback_side_channel)",
            ["kind"],
            registry=registry,
        )
        self.problems: dict[str, dict[str, str]] = {}  # replica -> kind -> what to do

    def problem(self, kind: str, replica: str, *args: object) -> None:
        """A misconfiguration seen on ``replica``: counted always, logged once per kind."""
        self.problems_total.labels(kind).inc()
        seen = self.problems.setdefault(replica, {})
        if kind not in seen:
            text = PROBLEMS[kind] % (replica, *args)
            seen[kind] = text
            log.warning("%s", text)

    def ready_detail(self) -> dict[str, dict[str, str]]:
        """For ``/ready``'s detail: each replica's problems in words."""
        return {url: dict(kinds) for url, kinds in sorted(self.problems.items())}
