"""The three reuse numbers of an answered request, counted per model and tenant
(``prefix_router_reuse_*_tokens_total``; docs/diagnostics.md, "Reuse: available, captured,
delivered"), in the vocabulary diagnose and explain use too:

- **available**: the longest prefix any candidate replica held at the decision (the most
  matched blocks among its scores, filtered candidates included), in tokens;
- **captured**: what the chosen replica held (its matched blocks: the prediction the
  ``x-prefix-router-cached-blocks`` header carries);
- **delivered**: what the engine reported (``usage.prompt_tokens_details.cached_tokens``).

available - captured is reuse the routing choice left behind (a spill under load, a filter);
captured - delivered is reuse the index believed in and the engine did not serve (an
eviction since, a misprediction). The matches are the index's: a policy that never reads
it (round_robin, random, consistent_hash, least_loaded) captures 0 of 0 available.
Requests served without reading the cache (prompt logprobs) are left out: their 0 says
nothing about the cache.
"""

from __future__ import annotations

from operator import attrgetter

from router.intake.routed_request import RoutedRequest
from router.schedule import Decision
from router.telemetry.metrics import Metrics
from router.upstream.proxy import Outcome

_MATCHED = attrgetter("matched_blocks")


def account(
    metrics: Metrics, rr: RoutedRequest, decision: Decision, outcome: Outcome, skips: bool
) -> None:
    """Count an answered request's reuse. ``skips``: it was served without reading the cache
    (``skips_cache_read``, which the learner reads once for this and for itself)."""
    if outcome.status >= 400 or skips:
        return
    bs = rr.block_size
    captured = decision.matched_blocks
    available = max(captured, max(map(_MATCHED, decision.scores), default=0))
    prompt, held, chosen, reported = metrics.reuse_series(rr.model, rr.tenant)
    prompt.inc(rr.num_tokens)
    held.inc(available * bs)
    chosen.inc(captured * bs)
    if outcome.cached_tokens is not None:
        reported.inc(min(outcome.cached_tokens, rr.num_tokens))
