"""The named policies: each a parameters dataclass composing plugins with weights.

``ring_spill`` (the default, pickers/ring_spill.py) keeps a prefix on as few replicas as its
traffic needs and spills it along its own ring under pressure. ``ttft`` minimises the
estimated time to first token, in prompt-token units:

    cost(r) = uncached_prefill (tokens r must prefill)  x 1
            + queued_tokens    (tokens queued ahead)    x 1
            + inflight         (requests in flight)     x decode_cost_tokens
            + kv_pressure      (KV-cache usage, 0..1)   x kv_pressure (0: off)

among the replicas within both bounds (in flight now, and share of recent requests; both
``load_bound x mean``), ties broken by ring order; a prefix nobody eligible holds goes to its
ring owner. ``ring_spill`` (pickers/ring_spill.py) keeps a prefix on its holders and spills it
along its own ring under pressure. The others are baselines for A/B runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.schedule import registry
from router.schedule.pipeline import Pipeline
from router.schedule.recent import RecentCounts
from router.schedule.registry import PluginSpec, ProfileSpec
from router.schedule.ring import HashRing

__all__ = ["POLICIES", "RecentCounts", "build_policy"]


def _check_c(c: float) -> None:
    if c < 1.0:
        raise ValueError(f"load_bound must be >= 1.0, got {c}")


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


def build_policy(
    name: str, ring: HashRing, load_bound: float = 1.25, decode_cost_tokens: float = 8.0
) -> Pipeline:
    """A named policy with today's fleet-wide knobs (each applies where the policy has it)."""
    knobs = {"load_bound": load_bound, "decode_cost_tokens": decode_cost_tokens}
    return registry.build_named(name, ring, knobs=knobs)
