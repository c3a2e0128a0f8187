"""What the scheduling plugins exchange: candidates in, a decision out, and their protocols.

A decision runs ``candidates -> filters -> scorers -> picker``. Filters say who may not take
the request, scorers add weighted cost terms, the picker chooses among the eligible ones.
Each plugin is a class with a nested ``Params`` dataclass, built from a name and a mapping of
parameters (``registry.build``); ``parse_params`` turns that mapping into the dataclass.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from router.core.blocks import cacheable_blocks
from router.core.record import record
from router.intake.routed_request import RoutedRequest
from router.schedule.keys import routing_key
from router.schedule.recent import RecentCounts
from router.schedule.ring import HashRing


class ScheduleError(ValueError):
    """A scheduling spec problem (unknown plugin or parameter, bad value), phrased for the
    person who wrote the config; ``router.config`` reports it as a ``ConfigError``."""


@record
class Candidate:
    """One healthy replica as the scheduler sees it for one decision (read-only)."""

    url: str
    matched_blocks: int = 0  # leading blocks the index says it holds
    inflight: int = 0  # requests in flight from all gateways
    pending_prefill_tokens: int = 0  # prompt tokens sent but not yet answered (first byte)
    waiting: int = 0  # scraped vllm:num_requests_waiting
    running: int = 0  # scraped vllm:num_requests_running
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc
    ttft_s: float = 0.0  # time to first byte this gateway observed lately (decayed mean)
    # Of matched_blocks, those only an offload tier holds (they follow the GPU's run: vLLM
    # loads them instead of computing them), and what one is worth next to a GPU block.
    offloaded_blocks: int = 0
    offload_weight: float = 1.0

    @property
    def load(self) -> int:
        """Requests in flight to the replica from the gateways. The scraped vLLM gauges are
        up to a scrape interval old, and at a few dozen requests a second a stale count
        misdirects more than it informs, so the default policy does not read them."""
        return self.inflight


@record
class ScoredCandidate:
    """A candidate after filters and scorers: ``cost`` is the sum of ``terms`` (read-only)."""

    url: str
    matched_blocks: int  # capped at the prompt's cacheable blocks
    load: int
    cost: float
    terms: Mapping[str, float] = field(default_factory=dict)  # scorer name -> weighted term
    filtered: str | None = None  # why it was not eligible (the filter's reason), if it was not
    filtered_by: str | None = None  # the filter that removed it
    offloaded_blocks: int = 0  # of matched_blocks, those only an offload tier holds
    weighted_blocks: float = 0.0  # matched_blocks, an offloaded one at its weight: pickers rank it


class Branch(enum.Enum):
    """Which way a decision went: a picker's branch. Its value is the ``reason`` of a
    ``Decision``, of explain's answer and of ``prefix_router_decisions_total``."""

    PREFIX = "prefix"  # a holder of the longest prefix, within its bounds
    SPILL = "spill"  # off the longest holder, under load (``SpillCause`` says why)
    RING = "ring"  # no eligible replica holds any of the prefix: by the ring (or queues)


class SpillCause(enum.Enum):
    """Why a spill left the holders, when the picker knows (else the filter that removed
    the longest holder, by its name, or ``COST``). Its value labels
    ``prefix_router_spills_total``."""

    QUEUE_CAP = "queue_cap"  # every holder's queue is over the picker's cap
    OBSERVED_TTFT = "observed_ttft"  # the holder's observed time to first byte is over its cap
    COST = "cost"  # the scorers' cost: the prefill saved did not outweigh the load


@record
class Decision:
    """Where a request goes and why, in three words of increasing detail: ``reason`` (a
    ``Branch`` value, or the policy's name for a picker without branches: a metrics label),
    ``cause`` (a spill's: a ``SpillCause`` value or a filter's name: a metrics label) and
    ``why`` (one sentence for operators)."""

    replica: str
    matched_blocks: int  # predicted cached blocks on the chosen replica
    reason: str  # a Branch's value, or the policy's name
    policy: str
    scores: tuple[ScoredCandidate, ...] = ()
    ring_choice: str | None = None
    why: str = ""  # one sentence for operators, from the picker
    cause: str | None = None  # a spill's: a SpillCause's value, or the removing filter's name
    holders: int = 0  # replicas holding the prompt's first block: the prefix's replica set
    copied_blocks: int = 0  # a spill's blocks new to its replica (each may evict one there)
    prefix_key: int = 0  # the request's ring key (block 0's hash): whose prefix this is
    uncached_tokens: int = 0  # prompt tokens the chosen replica is predicted to prefill
    offloaded_blocks: int = 0  # of matched_blocks, those the chosen replica loads from a tier

    @property
    def terms(self) -> dict[str, dict[str, float]]:
        """replica -> scorer -> weighted cost term."""
        return {s.url: dict(s.terms) for s in self.scores}

    @property
    def filtered(self) -> dict[str, str]:
        """replica -> the filter that removed it (only the removed ones)."""
        return {s.url: s.filtered_by for s in self.scores if s.filtered_by}


@record
class Pick:
    """A picker's choice (read-only)."""

    replica: str
    branch: Branch | None = None  # None: a picker without branches (the policy's name)
    why: str = ""
    ring_choice: str | None = None
    cause: SpillCause | None = None  # a spill's, when the picker knows it


@dataclass(slots=True)
class Cycle:
    """One decision's inputs, shared by its plugins."""

    req: RoutedRequest
    candidates: Sequence[Candidate]
    ring: HashRing
    recent: RecentCounts  # requests placed per replica, decayed (the pipeline keeps it)
    limit: int = 0  # cacheable blocks of the prompt
    key: int = 0  # the request's ring key (``routing_key``), read by several plugins

    def __post_init__(self) -> None:
        self.limit = cacheable_blocks(self.req.num_tokens, self.req.block_size)
        self.key = routing_key(self.req)

    def held(self, c: Candidate) -> int:
        """Blocks ``c`` holds that the request can reuse."""
        return min(c.matched_blocks, self.limit)

    def tiered(self, c: Candidate) -> tuple[int, float]:
        """Of ``held(c)``, the blocks only an offload tier holds, and what all of them
        are worth: a GPU block 1, an offloaded one ``c.offload_weight``."""
        held = c.matched_blocks if c.matched_blocks < self.limit else self.limit
        gpu = c.matched_blocks - c.offloaded_blocks
        off = held - gpu if held > gpu else 0
        return off, held - (1.0 - c.offload_weight) * off


class Hook(enum.Enum):
    """The request lifecycle hooks a plugin may declare (``Plugin.hooks``); the method of
    each is named by its value. ``now`` is the pipeline's clock (virtual in simulations)."""

    PLACED = "placed"  # placed(decision, now): the request is being sent as decided
    FIRST_BYTE = "first_byte"  # first_byte(decision, now): the replica's first bytes came
    DONE = "done"  # done(decision, status, now): the attempt ended (status None: no answer)


class Plugin(Protocol):
    """What every plugin declares. A plugin class subclasses its kind (``Filter``,
    ``Scorer``, ``Picker``) and so inherits these defaults, setting what it uses;
    ``check_plugin`` holds the declarations against the class when a profile is built."""

    name: ClassVar[str]
    # Reads ``Candidate.matched_blocks``: a decision needs the index lookup.
    uses_index: ClassVar[bool] = False
    # Reads ``Cycle.recent``: the pipeline counts the requests it places.
    uses_recent: ClassVar[bool] = False
    # The lifecycle hooks it implements.
    hooks: ClassVar[frozenset[Hook]] = frozenset()
    # Decides the same on a lazy head as on the whole prompt, given the same matched blocks
    # (router/routing/lazy_tail.py routes on a head only when every plugin does): a filter or picker
    # that never reads the prompt's length; a scorer whose terms are integers (token or
    # request counts), so the tail's estimate, added alike to every candidate, changes no
    # comparison.
    exact_on_head: bool = False

    def placed(self, decision: Decision, now: float) -> None:
        """``Hook.PLACED``: the request is being sent to ``decision.replica``."""

    def first_byte(self, decision: Decision, now: float) -> None:
        """``Hook.FIRST_BYTE``: the replica's first bytes arrived (a stream's prefill ended)."""

    def done(self, decision: Decision, status: int | None, now: float) -> None:
        """``Hook.DONE``: the attempt ended; ``status`` is None when the replica never
        answered (it failed before the first byte, or the client left)."""


class Filter(Plugin, Protocol):
    reason: ClassVar[str]  # shown for each candidate it removes

    def remove(self, cycle: Cycle) -> set[str]:
        """URLs of the candidates that may not take this request. Judges the full list."""
        ...


class Scorer(Plugin, Protocol):
    def score(self, cycle: Cycle, c: Candidate) -> float:
        """An unweighted cost term for ``c``; lower is better."""
        ...


class Picker(Plugin, Protocol):
    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        """Choose among ``scored`` (those with ``filtered is None`` are eligible; at least one
        is)."""
        ...


_DECLARED = ("uses_index", "uses_recent", "hooks", "exact_on_head")


def check_plugin(plugin: object, kind: str, where: str = "schedule") -> None:
    """Hold a plugin's declarations against its class: every declaration present (a class
    that does not subclass its kind must make them all), and a hook method defined exactly
    for each hook it declares (an undeclared one would never be called)."""
    name = getattr(plugin, "name", type(plugin).__name__)
    missing = [d for d in _DECLARED if not hasattr(plugin, d)]
    if missing:
        raise ScheduleError(
            f"{where}: {kind} {name} does not declare {', '.join(missing)} "
            f"(subclass router.schedule.types.{kind.capitalize()} for the defaults)"
        )
    for hook in Hook:
        defined = getattr(type(plugin), hook.value, None)
        implemented = defined is not None and defined is not getattr(Plugin, hook.value)
        if implemented != (hook in plugin.hooks):  # type: ignore[attr-defined]
            said = "defines" if implemented else "declares"
            but = "does not declare" if implemented else "does not define"
            raise ScheduleError(
                f"{where}: {kind} {name} {said} {hook.value} but {but} it "
                f"(hooks = frozenset({{Hook.{hook.name}}}) and a method {hook.value})"
            )


@dataclass(frozen=True)
class NoParams:
    pass


def parse_params(cls: type[Any], raw: Mapping[str, Any], where: str) -> Any:
    """``cls`` (a dataclass) from a mapping: unknown names and values of the wrong type are
    a ``ScheduleError`` naming the valid ones; ``__post_init__`` may check ranges."""
    if not isinstance(raw, Mapping):
        raise ScheduleError(f"{where}: params must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(fields) if fields else "none (it takes no parameters)"
        raise ScheduleError(f"{where}: unknown parameter {unknown[0]!r}; valid: {valid}")
    values = {name: _coerce(hints[name], value, f"{where}: {name}") for name, value in raw.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"{where}: {e}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool and isinstance(value, bool):
        return value
    if tp in (int, float) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if tp is float and not math.isnan(number):
            return number
        if tp is int and number.is_integer():
            return int(number)
    if tp is str and isinstance(value, str):
        return value
    raise ScheduleError(f"{where} must be {getattr(tp, '__name__', tp)}, got {value!r}")
