"""Why the prefix-cache hit rate is low, and where.

The seeds' procedure, automated: replay the window's prompts through one unlimited cache for
the **ideal** hit rate, compare it with the three reuse numbers (**available** in the fleet,
**captured** by the routing choice, **delivered** by the engine: router/routing/reuse.py),
split the gap into causes, and find the line of the prompt that breaks the prefix with a
**first-divergence histogram**.

Three ways in: ``GET /admin/diagnostics`` (live, ``LiveDiagnostics`` watches every finished
request), ``prefix-router diagnose FILE`` (offline, on captured request bodies, tokenized by the
gateway's own ``RequestPath.prepare``), and :func:`analyze` (a pure function over a sequence of
:class:`Sample`).

Quantities (all in prompt tokens, per request; rates are sums over the window / prompt tokens)
-------------------------------------------------------------------------------------------
``n``  prompt tokens.
``I``  ideal: what one unlimited cache holding every earlier request of the window (same model;
       salt and LoRA separate, as in vLLM) would serve. vLLM's rules: full blocks only, the
       longest run from block 0, capped at ``n - 1`` tokens. Prompt blocks only: the generated
       tokens' ids are not known to the gateway (vLLM caches them too, see ``beyond ideal``).
``A``  available: the most matched blocks among the decision's candidates (what the replica
       holding the longest prefix held, by the index).
``P``  captured: the chosen replica's matched blocks in the decision (the index's belief: the
       prediction).
``R``  replayed placement: what the chosen replica would hold with unlimited memory, given where
       this gateway actually sent the window's earlier requests.
``C``  reusable where placed = ``min(I, max(R, P))``: the part of the ideal the chosen replica
       should have held. Offline (no placement) ``C = I``.
``D``  delivered: ``usage.prompt_tokens_details.cached_tokens``. vLLM omits the field on a miss,
       so once a replica has reported it at least once a missing value counts as 0; before
       that, ``D`` is unknown (unreported).

Attribution rule (a waterfall; the four parts add up to ``n``)
--------------------------------------------------------------
* ``delivered = D``
* ``capacity  = max(0, C - D)``            reusable, placed where it was, yet not served: the
  replica evicted it before the reuse (or lost it: restart, reset).
* ``placement = max(0, I - max(C, D))``     an unlimited cache had it, but the chosen replica
  did not: another replica held more (from the replay, and the decision's scores).
* ``layout    = n - max(I, D)``             not reusable even by one unlimited cache: the prompt
  diverges from every earlier prompt there (a volatile line, reordered tools, new content).

When ``D`` is unknown, ``capacity`` cannot be seen: ``layout`` and ``placement`` are as above
and ``C`` is reported as *unreported*. ``D > I`` (blocks cached before the window began,
generated tokens, another gateway's traffic) is counted as a hit and reported as
*beyond ideal*. The order is deliberate: a token is blamed on the cheapest explanation that
covers it (the prompt first, then routing, then memory), so eviction is only claimed for tokens
that were reusable *and* correctly placed. Separately, ``index_spills`` counts decisions whose
captured was below their available (a load spill).

Divergence
----------
For consecutive requests of the same (model, tenant, app) group the first differing token index
is bucketed (0-15, 16-63, 64-255, 256-1023, 1024-4095, 4096+). A divergence is *early* when it
leaves more than half of the shorter prompt behind it, and *breaking* when it leaves at least a
full block; a pair where one prompt continues the other (a conversation's next turn) is
*extending*. Culprits come from the tallest buckets (early pairs first, then breaking ones),
each at its most common index, with the decoded text just before and after the point and the
line around it. A breaking pair whose prompts agree again within ``MAX_SPAN`` tokens for at
least a block gives a *reordering* suggestion: the volatile span, the line holding it, where
the shared text after it ends, and the block-aligned tokens that moving the span behind that
text would make reusable. Two cheap checks on the bodies add hints: the same tools in another
order, and another ``cache_salt`` / adapter (which shares nothing by design). Redaction drops
every text field; positions, counts and the heuristic kind labels stay.

Verdict
-------
The largest of layout / placement / capacity, except that layout is only named the cause when
it is fixable (early divergences in >= 25% of pairs, reordered tools in >= 25%, or reordering
suggestions unlocking >= 10% of prompt tokens); otherwise the unreusable tokens are new content,
and the larger of placement / capacity is the cause if it costs >= 5% of prompt tokens, else
the traffic is *healthy*.

Decode-bound: when completion tokens are at least ``DECODE_BOUND_RATIO`` x prompt tokens, the
time goes into sequential decode steps, which the prefix cache does not shorten.

Bounds (live): at most ``max_requests`` records, ``max_age_s`` seconds and ``max_blocks``
prompt blocks in the window (the two generations of block-hash maps hold at most twice that),
``pairs_per_group`` divergence records per group (~100 packed context token ids each),
``max_groups`` groups, and ``max_held_tokens`` token ids in total held as the groups' previous
requests (a reference to the gateway's own list, not a copy). ``observe`` costs O(log n) hash
lookups, one C-level dict update per block for the ideal and one for the replay, an O(log n)
hash comparison with the group's previous request, a few small slices and, when a volatile
span is found, one C-level comparison of the run after it: no per-token Python loop.

Modules (each imports only those above it): ``analysis`` (samples, comparisons, attribution,
records), ``report`` (records -> the report), ``window`` (the sliding window, ``analyze``),
``render`` (text), ``live`` (the gateway observer), ``http`` (the admin endpoint), ``command``
(the CLI subcommand).
"""

from router.ops.diagnose.analysis import (
    BUCKETS,
    Sample,
    attribute,
    bucket_of,
    find_resync,
    first_divergence,
)
from router.ops.diagnose.command import main
from router.ops.diagnose.http import handle
from router.ops.diagnose.live import LiveDiagnostics
from router.ops.diagnose.render import render_text
from router.ops.diagnose.window import Window, analyze

__all__ = [
    "BUCKETS",
    "LiveDiagnostics",
    "Sample",
    "Window",
    "analyze",
    "attribute",
    "bucket_of",
    "find_resync",
    "first_divergence",
    "handle",
    "main",
    "render_text",
]
