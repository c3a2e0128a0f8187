"""Bounded-queue spill along the prefix's own ring: the copies a spill makes are reused.

The prefix's ring order (from block 0's hash: a tenant's system prompt) is its replica list.
A request goes to the first replica in that order that holds the longest prefix and whose
queue (prompt tokens sent, no first byte yet) is within ``queue_cap_tokens``; if every holder
is over the cap, to the first replica in ring order whose estimated cost (the scorers') is
below the cheapest holder's by more than the cap (the spill must pay for the copy it makes),
else it stays on the cheapest holder. So a hot tenant spills to
the next replica on its ring, which then holds the copy the following spills reuse, instead of
seeding copies wherever a queue happens to be short. A prefix nobody holds goes to the replica
with the shortest queue; among those, to one that took the least prefill work lately
(uncached prompt tokens placed, decayed, compared coarsely: ``recent.least_recent``), then
the fewest in flight, then ring order; so cold tenants spread, then stay where they landed.
On an idle fleet the queues tie, and a tenant's first request (uncached, the longest prefill
it will send) went by in-flight counts and ring order, beside whichever tenants were there;
it goes beside the least traffic. The work is compared before the requests in flight: a
decoding request is gone in a moment, a tenant's traffic stays.

The token queue understates a replica's wait when decode shares its steps or other gateways
filled it since the last load sync. Two inputs see that: ``ttft_cap_s`` (a holder whose observed
time to first byte on mostly cached prompts, ``Candidate.ttft_s``, is over it counts as over the
cap, and when no spill beats it on tokens the request goes to the next on the ring within both
caps), and the policy's in-flight bound (``load_bound`` at ``inflight_bound x`` the mean, looser
than ttft's 1.25 so a hot prefix is not pushed off its holders by a few decoding requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import router.schedule.registry as registry
from router.schedule.recent import least_recent
from router.schedule.types import Branch, Cycle, Pick, Picker, ScoredCandidate, SpillCause


@registry.picker("ring_spill")
class RingSpill(Picker):
    """Invariant: with some eligible holder, the first eligible holder of the longest held
    prefix in ring order (block 0's key) whose pending prefill tokens are <= the cap
    (``prefix``); else the first eligible candidate in ring order whose cost is below the
    cheapest holder's by more than the cap (``spill``); else that cheapest holder. With no holder,
    among the eligible candidates with the fewest pending tokens, those whose recent work is at
    most ``RECENT_RATIO`` x their least or that took at most ``RECENT_FLOOR`` requests lately,
    then the fewest in flight, then ring order (``ring``). ``why`` names the ring position and
    the queues."""

    @dataclass(frozen=True)
    class Params:
        queue_cap_tokens: float = 1024.0  # queued prompt tokens a replica may carry
        ttft_cap_s: float = 0.0  # observed time to first byte a holder may show (0: off)

        def __post_init__(self) -> None:
            if self.queue_cap_tokens < 0:
                raise ValueError(f"queue_cap_tokens must be >= 0, got {self.queue_cap_tokens}")
            if self.ttft_cap_s < 0:
                raise ValueError(f"ttft_cap_s must be >= 0, got {self.ttft_cap_s}")

    name = "ring_spill"
    uses_index = True
    uses_recent = True  # a prefix nobody holds goes where the least work went lately

    def __init__(self, params: Params) -> None:
        self.cap = params.queue_cap_tokens
        self.ttft_cap = params.ttft_cap_s
        self._cap_text = f"{self.cap:.0f}"  # as every ``why`` shows it
        # Length-blind; a fractional cap, though, would compare differently once a lazy
        # head's estimate moves the costs it is added to.
        self.exact_on_head = float(self.cap).is_integer()

    def pick(self, cycle: Cycle, scored: Sequence[ScoredCandidate]) -> Pick:
        cands = {c.url: c for c in cycle.candidates}
        # The eligible, the longest held prefix among them (best) and among all (most), in
        # one pass: matched blocks are never negative, and some candidate is eligible.
        eligible = {}
        best = most = 0.0
        for s in scored:
            m = s.weighted_blocks  # matched blocks, an offloaded one at its weight
            if m > most:
                most = m
            if s.filtered is None:
                eligible[s.url] = s
                if m > best:
                    best = m
        order = [u for u in cycle.ring.order(cycle.key) if u in eligible]
        if len(order) < len(eligible):
            order += sorted(set(eligible) - set(order))  # not on the ring yet
        pos = {u: i for i, u in enumerate(order)}
        owner = order[0]
        if best == 0:
            pending = {u: cands[u].pending_prefill_tokens for u in order}
            low = min(pending.values())
            tied = [u for u in order if pending[u] == low]
            recent = cycle.recent.both(tied)
            u = min(least_recent(tied, recent), key=lambda u: (cands[u].inflight, pos[u]))
            return Pick(
                u,
                Branch.RING,
                f"nobody holds this prefix: the shortest queue ({pending[u]} tokens), "
                f"recent work {recent[u][1]:.0f} tokens (least "
                f"{min(w for _, w in recent.values()):.0f}), {cands[u].inflight} in flight, "
                f"ring position {pos[u]}",
                owner,
            )

        cap, ttft_cap = self.cap, self.ttft_cap
        held = [u for u in order if eligible[u].weighted_blocks == best]
        # Where the prefix's replica set stands: how many hold it, at which ring positions.
        note = f" [held by {len(held)} at ring positions {','.join([str(pos[u]) for u in held])}]"
        for u in held:
            queued = cands[u].pending_prefill_tokens
            if queued <= cap and not (ttft_cap and cands[u].ttft_s > ttft_cap):  # not slow(u)
                branch = Branch.PREFIX if best == most else Branch.SPILL
                return Pick(
                    u,
                    branch,
                    f"holds the prefix, queue {queued} <= cap "
                    f"{self._cap_text}; ring position {pos[u]}" + note,
                    owner,
                )

        def slow(u: str) -> bool:
            return bool(ttft_cap) and cands[u].ttft_s > ttft_cap

        stay = min((eligible[u] for u in held), key=lambda s: (s.cost, pos[s.url]))
        for u in order:  # spill only where it saves more than the cap, in ring order
            if eligible[u].cost + self.cap < stay.cost and not slow(u):
                why = (
                    f"every holder is over a cap and this saves "
                    f"{stay.cost - eligible[u].cost:.0f} tokens (> the queue cap "
                    f"{self.cap:.0f}): next on the prefix's ring, position {pos[u]}"
                )
                branch = Branch.PREFIX if eligible[u].weighted_blocks == most else Branch.SPILL
                return Pick(u, branch, why + note, owner, cause=SpillCause.QUEUE_CAP)
        if slow(stay.url):  # its wait is longer than the tokens say (decode, other gateways)
            for u in order:
                if cands[u].pending_prefill_tokens <= self.cap and not slow(u):
                    why = (
                        f"every holder is over a cap and the cheapest one's observed time to "
                        f"first byte {cands[stay.url].ttft_s:.2f} s is over {self.ttft_cap:g} s: the "
                        f"next on the prefix's ring within both caps, position {pos[u]}"
                    )
                    branch = Branch.PREFIX if eligible[u].weighted_blocks == most else Branch.SPILL
                    return Pick(u, branch, why + note, owner, cause=SpillCause.OBSERVED_TTFT)
        branch = Branch.PREFIX if stay.weighted_blocks == most else Branch.SPILL
        why = (
            f"holders are over the cap {self.cap:.0f} but no spill saves more: the cheapest holder"
        )
        return Pick(stay.url, branch, why + note, owner)
