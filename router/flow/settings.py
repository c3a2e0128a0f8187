"""A tenant's flow-control settings, as the tenancy table gives them (``tenants.<name>``:
``weight``, ``band``, ``rpm``, ``tpm``, ``max_queue``, ``queue_timeout_s``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.config import ConfigError
from router.flow.fairqueue import BANDS

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
