"""Flow control's settings: a tenant's, as the tenancy table gives them (``tenants.<name>``:
``weight``, ``band``, ``rpm``, ``tpm``, ``max_queue``, ``queue_timeout_s``), and the
controller's own (``FlowConfig``, from the config's flow section)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.config import ConfigError
from router.flow.fairqueue import BANDS
from router.flow.saturation import Thresholds

FLOW_KEYS = ("weight", "band", "rpm", "tpm", "max_queue", "queue_timeout_s")


@dataclass(frozen=True, slots=True)
class FlowSettings:
    weight: float = 1.0  # share of the fleet while saturated, relative to other tenants
    band: str = "standard"  # critical / standard / sheddable: strict priority
    rpm: int | None = None  # requests per minute (None: no limit)
    tpm: int | None = None  # prompt + max output tokens per minute (None: no limit)
    max_queue: int | None = None  # queued requests at most (None: the gateway's default)
    queue_timeout_s: float | None = None  # longest wait in the queue (None: the default)


def parse_flow(spec: Mapping[str, Any], where: str) -> FlowSettings:
    """The flow fields of one tenant's entry; anything malformed is a ConfigError that names
    the tenant and the field."""

    def number(key: str, integer: bool) -> Any:
        value = spec.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0 or (integer and int(value) != value):
            kind = "a positive integer" if integer else "a positive number"
            raise ConfigError(f"{where}: {key} must be {kind}, got {value!r}")
        return int(value) if integer else float(value)

    band = spec.get("band", "standard")
    if band not in BANDS:
        raise ConfigError(f"{where}: band must be one of {', '.join(BANDS)}, got {band!r}")
    weight = number("weight", False)
    return FlowSettings(
        weight=1.0 if weight is None else weight,
        band=band,
        rpm=number("rpm", True),
        tpm=number("tpm", True),
        max_queue=number("max_queue", True),
        queue_timeout_s=number("queue_timeout_s", False),
    )


@dataclass(frozen=True, slots=True)
class FlowConfig:
    enabled: bool = False
    thresholds: Thresholds = Thresholds()
    max_queue_per_tenant: int = 256
    max_queue: int = 4096
    queue_timeout_s: float = 30.0
    decode_token_cost: float = 1.0  # prefill tokens one expected output token costs
    default_output_tokens: int = 256  # expected output when the request gives no max_tokens
    history_tokens: float = 200_000.0  # how far past usage may hold a tenant back (per weight)
    burst_tokens: float = 4096.0  # credit an under-share tenant may spend ahead (fairqueue)
    tick_s: float = 0.05  # re-check the replicas' signals this often while requests wait
    alone_window_s: float = 10.0  # a second tenant's request makes the gate fair this long

    @classmethod
    def from_config(cls, config: Any, tenants: bool) -> FlowConfig:
        """``tenants``: requests carry a tenant (auth or a tenant header), which turns flow
        control on unless the config says otherwise."""
        return cls(
            enabled=tenants if config.enabled is None else config.enabled,
            thresholds=Thresholds(
                prefill_per_replica=config.flow_prefill_per_replica,
                waiting_max=config.flow_waiting_max,
                kv_usage_max=config.flow_kv_usage_max,
                ttft_max_s=config.flow_ttft_max_s,
                step_tokens=config.flow_step_tokens,
            ),
            max_queue_per_tenant=config.flow_max_queue_per_tenant,
            max_queue=config.flow_max_queue,
            queue_timeout_s=config.flow_queue_timeout_s,
            decode_token_cost=config.flow_decode_token_cost,
            history_tokens=config.flow_history_tokens,
            burst_tokens=config.flow_burst_tokens,
        )
