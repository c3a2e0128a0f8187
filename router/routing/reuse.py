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

from router.intake.parse import skips_cache_read
from router.intake.routed_request import RoutedRequest
from router.schedule import Decision
from router.telemetry.metrics import Metrics
from router.upstream.proxy import Outcome


def account(metrics: Metrics, rr: RoutedRequest, decision: Decision, outcome: Outcome) -> None:
    if outcome.status >= 400 or skips_cache_read(rr.body, rr.endpoint):
        return
    bs, model, tenant = rr.block_size, rr.model, rr.tenant
    captured = decision.matched_blocks
    available = max(captured, max((s.matched_blocks for s in decision.scores), default=0))
    m = metrics
    m.child(m.reuse_prompt_tokens, model, tenant).inc(rr.num_tokens)
    m.child(m.reuse_available_tokens, model, tenant).inc(available * bs)
    m.child(m.reuse_captured_tokens, model, tenant).inc(captured * bs)
    if outcome.cached_tokens is not None:
        delivered = min(outcome.cached_tokens, rr.num_tokens)
        m.child(m.reuse_delivered_tokens, model, tenant).inc(delivered)
