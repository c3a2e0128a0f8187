"""The named policies: each a parameters dataclass composing plugins with weights. A
policy is built one way: ``spec.from_config`` (the config's ``schedule`` and flags) ->
``registry.build_named`` (a name, its parameters and the fleet-wide knobs) ->
``registry.build`` (a profile) -> a ``Pipeline``.

``ring_spill`` (the default, ``registry.DEFAULT_POLICY``; its picker in pickers/ring_spill.py)
keeps a prefix on as few replicas as its traffic needs and spills it along its own ring under
pressure. ``ttft`` minimises the estimated time to first token, in prompt-token units:

    cost(r) = uncached_prefill (tokens r must prefill)  x 1
            + queued_tokens    (tokens queued ahead)    x 1
            + inflight         (requests in flight)     x decode_cost_tokens
            + kv_pressure      (KV-cache usage, 0..1)   x kv_pressure (0: off)

among the replicas within both bounds (in flight now, and share of recent requests; both
``load_bound x mean``), ties broken by ring order; a prefix nobody eligible holds goes to its
ring owner. The others are baselines for A/B runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import router.schedule.registry as registry
from router.schedule.recent import RecentCounts
from router.schedule.registry import PluginSpec, ProfileSpec

__all__ = ["POLICIES", "RecentCounts"]


def _check_c(c: float) -> None:
    if c < 1.0:
        raise ValueError(f"load_bound must be >= 1.0, got {c}")


@registry.policy("ring_spill")
@dataclass(frozen=True)
class RingSpillPolicy:
    """ttft's cost terms, a loose in-flight bound (no share bound), picked by
    ``ring_spill``: a prefix stays on its holders until their queues (or observed times to
    first byte) pass the caps, then spills along its own ring."""

    queue_cap_tokens: float = 1024.0
    decode_cost_tokens: float = 8.0
    ttft_cap_s: float = 3.0  # a holder whose observed time to first byte is over it sheds
    inflight_bound: float = 2.5  # load_bound's c on requests in flight now (0: no bound)
    # replica_set_bound's factor: replicas a prefix may hold per fair share of traffic (0: off)
    replica_set_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.inflight_bound and self.inflight_bound < 1.0:
            raise ValueError(f"inflight_bound must be 0 (off) or >= 1.0, got {self.inflight_bound}")
        if self.replica_set_factor < 0:
            raise ValueError(f"replica_set_factor must be >= 0, got {self.replica_set_factor}")

    def profile(self) -> ProfileSpec:
        filters = []
        if self.replica_set_factor:  # first: the harder bound, relaxed last
            filters.append(PluginSpec("replica_set_bound", {"factor": self.replica_set_factor}))
        if self.inflight_bound:
            filters.append(PluginSpec("load_bound", {"load_bound": self.inflight_bound}))
        return ProfileSpec(
            tuple(filters),
            (
                PluginSpec("uncached_prefill"),
                PluginSpec("queued_tokens"),
                PluginSpec("inflight", weight=self.decode_cost_tokens),
            ),
            PluginSpec(
                "ring_spill",
                {"queue_cap_tokens": self.queue_cap_tokens, "ttft_cap_s": self.ttft_cap_s},
            ),
        )


@registry.policy("ttft")
@dataclass(frozen=True)
class TTFT:
    load_bound: float = 1.25
    decode_cost_tokens: float = 8.0  # one request in flight, in prompt-token equivalents
    kv_pressure: float = 0.0  # tokens a full KV cache is worth avoiding (0: not scored)

    def __post_init__(self) -> None:
        _check_c(self.load_bound)

    def profile(self) -> ProfileSpec:
        c = {"load_bound": self.load_bound}
        return ProfileSpec(
            filters=(PluginSpec("load_bound", c), PluginSpec("recent_share", c)),
            scorers=(
                PluginSpec("uncached_prefill", weight=1.0),
                PluginSpec("queued_tokens", weight=1.0),
                PluginSpec("inflight", weight=self.decode_cost_tokens),
                PluginSpec("kv_pressure", weight=self.kv_pressure),
            ),
            picker=PluginSpec("ring_min_cost", c),
        )


@registry.policy("consistent_hash")
@dataclass(frozen=True)
class ConsistentHash:
    """The ring with bounded loads for every request; ignores the index."""

    load_bound: float = 1.25

    def __post_init__(self) -> None:
        _check_c(self.load_bound)

    def profile(self) -> ProfileSpec:
        return ProfileSpec((), (), PluginSpec("ring_owner", {"load_bound": self.load_bound}))


@registry.policy("round_robin")
@dataclass(frozen=True)
class RoundRobin:
    def profile(self) -> ProfileSpec:
        return ProfileSpec((), (), PluginSpec("round_robin"))


@registry.policy("sticky_prefix")
@dataclass(frozen=True)
class StickyPrefixPolicy:
    """Always the longest-prefix holder (a baseline for the pressure benchmark)."""

    def profile(self) -> ProfileSpec:
        return ProfileSpec((), (), PluginSpec("sticky_prefix"))


@registry.policy("random")
@dataclass(frozen=True)
class Random:
    seed: int | None = None

    def profile(self) -> ProfileSpec:
        return ProfileSpec((), (), PluginSpec("random", {"seed": self.seed}))


@registry.policy("least_loaded")
@dataclass(frozen=True)
class LeastLoaded:
    """Fewest requests in flight; ties broken at random."""

    seed: int | None = None

    def profile(self) -> ProfileSpec:
        return ProfileSpec(
            (), (PluginSpec("inflight", weight=1.0),), PluginSpec("random_min", {"seed": self.seed})
        )


POLICIES: Mapping[str, type[Any]] = registry._POLICIES  # name -> params class, live
