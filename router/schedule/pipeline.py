"""One policy as a pipeline: candidates -> filters -> weighted scorers -> picker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.intake.routed_request import RoutedRequest
from router.schedule.recent import RecentCounts
from router.schedule.ring import RingSource
from router.schedule.types import (
    Branch,
    Candidate,
    Cycle,
    Decision,
    Filter,
    Hook,
    Picker,
    Plugin,
    ScoredCandidate,
    Scorer,
    SpillCause,
    check_plugin,
)


class Pipeline:
    """Filters each judge the full candidate list; a candidate any of them removes is not
    eligible. Should they together remove everyone, the later filters are relaxed first
    (the earlier ones are the harder bounds) until someone is eligible. Each candidate's cost
    is the sum of its weighted scorer terms; the picker chooses among the eligible."""

    def __init__(
        self,
        name: str,
        ring: RingSource,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
    ) -> None:
        self.name = name
        self.ring = ring
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        for kind, group in (
            ("filter", self.filters),
            ("scorer", [s for s, _ in self.scorers]),
            ("picker", [picker]),
        ):
            for p in group:
                check_plugin(p, kind, f"policy {name}")
        plugins: list[Plugin] = [*self.filters, *(s for s, _ in self.scorers), picker]
        # Whether a decision needs the index lookup (matched blocks) at all.
        self.uses_index = any(p.uses_index for p in plugins)
        self._tracks_recent = any(p.uses_recent for p in plugins)
        # The request lifecycle hooks the plugins declare: before send (``placed``), first
        # byte, done.
        self._placers = [p for p in plugins if Hook.PLACED in p.hooks]
        self._first_byte = [p for p in plugins if Hook.FIRST_BYTE in p.hooks]
        self._done = [p for p in plugins if Hook.DONE in p.hooks]
        self.recent = RecentCounts()
        # (name, bound score method, weight) per scorer: looked up once, not per candidate.
        self._scoring = [(s.name, s.score, w) for s, w in self.scorers]

    def placed(self, decision: Decision) -> None:
        """The request is being sent as decided (not called for explain)."""
        if self._tracks_recent:
            self.recent.add(decision.replica, decision.uncached_tokens)
        for p in self._placers:
            p.placed(decision, self.recent.clock())

    def first_byte(self, decision: Decision) -> None:
        """The replica's first bytes arrived (a stream's: the end of its prefill)."""
        for p in self._first_byte:
            p.first_byte(decision, self.recent.clock())

    def done(self, decision: Decision, status: int | None) -> None:
        """The attempt at ``decision.replica`` ended: ``status`` is the replica's answer,
        None when there was none (it failed before the first byte, or the client left)."""
        for p in self._done:
            p.done(decision, status, self.recent.clock())

    def describe(self) -> dict[str, Any]:
        """The profile, for explain and docs."""
        return {
            "filters": [f.name for f in self.filters],
            "scorers": {s.name: w for s, w in self.scorers},
            "picker": self.picker.name,
        }

    def _removed(self, cycle: Cycle) -> dict[str, Filter]:
        everyone = len(cycle.candidates)
        removed: dict[str, Filter] = {}
        sizes = []  # how many the first j + 1 filters removed
        for f in self.filters:
            for url in f.remove(cycle):
                removed.setdefault(url, f)  # the first filter that removes it names why
            sizes.append(len(removed))
        if len(removed) < everyone:
            return removed
        for j in range(len(sizes) - 2, -1, -1):  # relax the later filters first
            if sizes[j] < everyone:
                kept = self.filters[: j + 1]
                return {url: f for url, f in removed.items() if any(f is k for k in kept)}
        return {}

    def choose(self, req: RoutedRequest, candidates: Sequence[Candidate]) -> Decision:
        # The request's model's own ring (a base model's, for its adapters too).
        entry = req.model_entry
        ring = self.ring.of(entry.name if entry is not None else req.model)
        cycle = Cycle(req, candidates, ring, self.recent)
        removed = self._removed(cycle)
        scored = []
        scorers = self._scoring
        limit = cycle.limit
        holders = 0
        for c in candidates:
            terms = {}
            for name, score, w in scorers:
                terms[name] = w * score(cycle, c)
            f = removed.get(c.url)
            held = c.matched_blocks if c.matched_blocks < limit else limit  # cycle.held(c)
            holders += held > 0
            off, weighted = cycle.tiered(c) if c.offloaded_blocks else (0, held)
            # Positional, in the field order (url, matched_blocks, load, cost, terms,
            # filtered, filtered_by, offloaded_blocks, weighted_blocks): keywords cost a dict per
            # candidate.
            scored.append(
                ScoredCandidate(
                    c.url,
                    held,
                    c.load,
                    sum(terms.values()),
                    terms,
                    f.reason if f else None,
                    f.name if f else None,
                    off,
                    weighted,
                )
            )
        pick = self.picker.pick(cycle, scored)
        for chosen in scored:
            if chosen.url == pick.replica:
                break
        else:  # a picker chooses among the candidates
            raise ValueError(f"picker {self.picker.name} chose {pick.replica!r}: not a candidate")
        reason = pick.branch.value if pick.branch is not None else self.name
        cause, copied = None, 0
        if pick.branch is Branch.SPILL:
            cause = pick.cause.value if pick.cause is not None else _spill_cause(scored)
            copied = max(s.matched_blocks for s in scored) - chosen.matched_blocks
        # Positional, in the field order (replica, matched_blocks, reason, policy, scores,
        # ring_choice, why, cause, holders, copied_blocks, prefix_key, uncached_tokens,
        # offloaded_blocks): thirteen keywords cost twice the call.
        return Decision(
            pick.replica,
            chosen.matched_blocks,
            reason,
            self.name,
            tuple(scored),
            pick.ring_choice,
            pick.why,
            cause,
            holders,
            copied,
            cycle.key,
            max(0, req.num_tokens - chosen.matched_blocks * req.block_size),
            chosen.offloaded_blocks,
        )


def _spill_cause(scored: Sequence[ScoredCandidate]) -> str:
    """Why a picker without its own label spilled: the filter that removed the longest
    holder, or the cost terms (``cost``)."""
    most = max(s.matched_blocks for s in scored)
    holder = next((s for s in scored if s.matched_blocks == most and s.filtered_by), None)
    return holder.filtered_by if holder and holder.filtered_by else SpillCause.COST.value
