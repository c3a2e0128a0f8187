"""The report: from the window's records and divergence pairs to the JSON an operator reads
(hit rates, where the prompt tokens went, the divergence histogram and its culprits,
reordering suggestions, the verdict)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from router.ops.diagnose.analysis import (
    BUCKETS,
    DECODE_BOUND_RATIO,
    SHOWN_CULPRITS,
    SHOWN_SUGGESTIONS,
    Decode,
    DecodeFor,
    GroupKey,
    Pair,
    Record,
    attribute,
    bucket_label,
    bucket_of,
    unpack,
)

_TIMESTAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}|\b\d{1,2}:\d{2}(:\d{2})?\b|\b(19|20)\d{2}\b.*\b\d{1,2}\b|"
    r"\b(mon|tue|wed|thu|fri|sat|sun)[a-z]*\b|\b(today|date|time)\b",
    re.IGNORECASE,
)
_IDENT = re.compile(
    r"\b(req(uest)?|trace|session|correlation)[ _-]?(id)?\b|\b[0-9a-f]{8,}\b|\buuid\b",
    re.IGNORECASE,
)
_TOOL = re.compile(r'"name"\s*:\s*"|"function"\s*:|<tools>', re.IGNORECASE)


def classify(text: str) -> list[str]:
    """What kind of volatile content a culprit line looks like (heuristic labels)."""
    kinds = []
    if _TOOL.search(text):
        kinds.append("tools")
    if _TIMESTAMP.search(text):
        kinds.append("timestamp")
    if _IDENT.search(text):
        kinds.append("request_id")
    return kinds or ["text"]


def _line_around(before: str, after: str, limit: int = 240) -> str:
    head = before.rsplit("\n", 1)
    tail = after.split("\n", 1)
    line = ("" if len(head) > 1 else "…") + head[-1] + tail[0] + ("" if len(tail) > 1 else "…")
    return line if len(line) <= limit else line[: limit - 1] + "…"


# -- report building --------------------------------------------------------------------------
def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def build_report(
    recs: Sequence[Record],
    pairs: Sequence[Pair],
    groups: Sequence[tuple[GroupKey, int]],
    *,
    block_size: int,
    scope: dict[str, Any],
    decode: DecodeFor | None,
    redact: bool,
    counters: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    n_total = sum(r.n for r in recs)
    ideal_total = sum(r.ideal for r in recs)
    placed = [r for r in recs if r.captured is not None]
    reported = [r for r in recs if r.delivered is not None]
    parts = {"delivered": 0, "layout": 0, "placement": 0, "capacity": 0, "unreported": 0}
    beyond = 0
    for r in recs:
        reusable = None
        if r.replica is not None:
            reusable = max(r.replayed or 0, r.captured or 0)
        a = attribute(r.n, r.ideal, reusable, r.delivered)
        for k in parts:
            parts[k] += a[k] or 0
        beyond += a["beyond_ideal"] or 0
    spills = [r for r in placed if (r.available or 0) > (r.captured or 0)]

    placed_n = sum(r.n for r in placed)
    rates: dict[str, Any] = {
        "ideal": _rate(ideal_total, n_total),
        "available": _rate(
            sum(
                min(r.available if r.available is not None else r.captured or 0, r.n)
                for r in placed
            ),
            placed_n,
        ),
        "captured": _rate(sum(r.captured or 0 for r in placed), placed_n),
        "delivered": _rate(
            sum(min(r.delivered or 0, r.n) for r in reported), sum(r.n for r in reported)
        ),
        "delivered_requests": len(reported),
    }
    if counters:
        hits = sum(h for h, _ in counters.values())
        queries = sum(q for _, q in counters.values())
        rates["replica_counters"] = {
            "hit_rate": _rate(hits, queries),
            "hits": int(hits),
            "queries": int(queries),
            "replicas": {
                u: {"hits": int(h), "queries": int(q), "hit_rate": _rate(h, q)}
                for u, (h, q) in sorted(counters.items())
            },
        }

    lost = {
        k: {"tokens": parts[k], "share": _rate(parts[k], n_total)}
        for k in ("layout", "placement", "capacity")
    }
    completion = sum(r.completion or 0 for r in recs)
    known_completion = any(r.completion is not None for r in recs)
    max_tok = sum(r.max_tokens or 0 for r in recs)
    if known_completion:
        ratio = completion / n_total if n_total else 0.0
        decode_bound: dict[str, Any] = {
            "flag": ratio >= DECODE_BOUND_RATIO,
            "basis": "completion_tokens",
            "completion_tokens": completion,
        }
    else:
        ratio = max_tok / n_total if n_total else 0.0
        decode_bound = {
            "flag": ratio >= DECODE_BOUND_RATIO,
            "basis": "max_tokens (an upper bound; completions unknown)",
            "max_tokens": max_tok,
        }
    decode_bound.update(prompt_tokens=n_total, ratio=round(ratio, 3), threshold=DECODE_BOUND_RATIO)

    divergence = _divergence_section(pairs, block_size, decode)
    suggestions = _suggestions(pairs, block_size, decode)
    span_s = (recs[-1].t - recs[0].t) if len(recs) > 1 else 0.0
    report: dict[str, Any] = {
        "scope": {
            **scope,
            "requests": len(recs),
            "prompt_tokens": n_total,
            "block_size": block_size,
            "window_s": round(span_s, 3),
            "redacted": redact,
        },
        "hit_rates": rates,
        "tokens": {
            "prompt": n_total,
            "ideal": ideal_total,
            "delivered": parts["delivered"],
            "beyond_ideal": beyond,
            "unreported": {
                "tokens": parts["unreported"],
                "share": _rate(parts["unreported"], n_total),
            },
            "lost": lost,
        },
        "index_spills": {
            "requests": len(spills),
            "tokens": sum((r.available or 0) - (r.captured or 0) for r in spills),
        },
        "decode_bound": decode_bound,
        "divergence": divergence,
        "suggestions": suggestions,
        "groups": [
            {"model": k[0], "tenant": k[1], "app": k[2], "requests": c} for k, c in groups[:20]
        ],
    }
    report["verdict"] = _verdict(report)
    return report


def _decoder(decode: DecodeFor | None, p: Pair) -> Decode | None:
    """The pair's own model's decoder (never another model's)."""
    return decode(p.model) if decode is not None else None


def _divergence_section(
    pairs: Sequence[Pair], bs: int, decode_for: DecodeFor | None
) -> dict[str, Any]:
    counts = [0] * len(BUCKETS)
    early = [0] * len(BUCKETS)
    breaking = [0] * len(BUCKETS)
    by_bucket: dict[int, list[Pair]] = {}
    for p in pairs:
        b = bucket_of(p.index)
        counts[b] += 1
        early[b] += p.early
        if p.breaks(bs):
            breaking[b] += 1
            by_bucket.setdefault(b, []).append(p)
    indexes = sorted(p.index for p in pairs)
    out: dict[str, Any] = {
        "pairs": len(pairs),
        "early_pairs": sum(early),
        "breaking_pairs": sum(breaking),
        "extending_pairs": sum(1 for p in pairs if p.extends),
        "tools_reordered_pairs": sum(1 for p in pairs if p.tools_reordered),
        "cache_key_differs_pairs": sum(1 for p in pairs if p.key_differs),
        "median_index": indexes[len(indexes) // 2] if indexes else None,
        "buckets": [
            {
                "range": bucket_label(lo, hi),
                "lo": lo,
                "hi": hi,
                "count": counts[i],
                "early": early[i],
                "breaking": breaking[i],
            }
            for i, (lo, hi) in enumerate(BUCKETS)
        ],
    }
    culprits = []
    # The tallest buckets of early divergences first, then of any divergence that loses a block.
    for b in sorted(by_bucket, key=lambda i: (-early[i], -breaking[i], i))[:SHOWN_CULPRITS]:
        ps = by_bucket[b]
        at = Counter(p.index for p in ps)
        index, n_at = max(at.items(), key=lambda kv: (kv[1], -kv[0]))
        example = next(p for p in reversed(ps) if p.index == index)
        lost = sorted(min(p.prev_len, p.cur_len) - p.index for p in ps)
        reordered = sum(1 for p in ps if p.tools_reordered)
        c: dict[str, Any] = {
            "bucket": bucket_label(*BUCKETS[b]),
            "pairs": len(ps),
            "early_pairs": early[b],
            "index": index,
            "pairs_at_index": n_at,
            "block": index // bs,
            "offset_in_block": index % bs,
            "median_tokens_after": lost[len(lost) // 2],
            "tools_reordered_pairs": reordered,
        }
        decode = _decoder(decode_for, example)
        if decode is not None:
            before = decode(unpack(example.before))
            after_cur = decode(unpack(example.after_cur))
            after_prev = decode(unpack(example.after_prev))
            c["line"] = _line_around(before, after_cur)
            c["previous_line"] = _line_around(before, after_prev)
            c["before"] = before
            c["after_previous"] = after_prev
            c["after_current"] = after_cur
            variants: list[str] = []
            for p in reversed(ps):
                if p.index == index and p.model == example.model:
                    v = _line_around(decode(unpack(p.before)), decode(unpack(p.after_cur)))
                    if v not in variants:
                        variants.append(v)
                    if len(variants) >= 3:
                        break
            c["variants"] = variants
            kinds = classify(c["line"] + "\n" + c["previous_line"])
        else:
            kinds = []
        if reordered * 2 >= len(ps):
            kinds = ["tool_order"] + [k for k in kinds if k not in ("tools", "text")]
        if kinds:
            c["kind"] = kinds
        culprits.append(c)
    out["culprits"] = culprits
    return out


def _context_slice(p: Pair, start: int, end: int) -> list[int]:
    """The current request's tokens [start, end) as far as the pair's context holds them."""
    ids = unpack(p.before) + unpack(p.after_cur)
    origin = p.index - len(p.before) // 4
    return ids[max(0, start - origin) : max(0, end - origin)]


def _is_boundary(text: str) -> bool:
    return "\n" in text or (text.startswith("<|") and text.endswith("|>"))


def _line_bounds(p: Pair, start: int, end: int, decode: Decode) -> tuple[int, int] | None:
    """Token bounds [a, b) of the line holding [start, end) in the current request, when the
    pair's context reaches both ends (a newline or a special token on each side)."""
    ids = unpack(p.before) + unpack(p.after_cur)
    origin = p.index - len(p.before) // 4
    lo, hi = start - origin, end - origin
    if lo < 0 or hi > len(ids) or lo >= hi:
        return None
    a = next((i + 1 for i in range(lo - 1, -1, -1) if _is_boundary(decode([ids[i]]))), None)
    b = None
    for i in range(max(lo, hi - 1), len(ids)):
        text = decode([ids[i]])
        if _is_boundary(text):
            b = i if text.startswith("<|") else i + 1  # a trailing newline belongs to the line
            break
    if a is None or b is None or b <= a:
        return None
    return a + origin, b + origin


def _suggestions(
    pairs: Sequence[Pair], bs: int, decode_for: DecodeFor | None
) -> list[dict[str, Any]]:
    """Reordering: clusters of pairs whose prompts agree again after a short volatile span."""
    out: list[dict[str, Any]] = []
    spans = sorted((p for p in pairs if p.resync is not None), key=lambda p: p.index)
    clusters: list[list[Pair]] = []
    cluster_end = -1
    for p in spans:
        assert p.resync is not None
        end = max(p.resync[1], p.index + 1)
        if clusters and p.index <= cluster_end + bs:
            clusters[-1].append(p)
            cluster_end = max(cluster_end, end)
        else:
            clusters.append([p])
            cluster_end = end
    scored = []
    for cl in clusters:
        gains, resumes = [], []
        end = 0
        for p in cl:
            assert p.resync is not None
            jp, jc, run = p.resync
            gains.append(((p.index + run) // bs - p.index // bs) * bs)
            resumes.append(jc + run)
            end = max(end, jc)  # the current request's coordinates
        if not any(gains):
            continue
        gains.sort()
        resumes.sort()
        start = min(p.index for p in cl)
        if end <= start:  # only the earlier requests carried extra tokens here
            end = max(max(p.resync[0], p.resync[1]) for p in cl if p.resync)
        scored.append((sum(gains), cl, start, end, resumes[len(resumes) // 2], gains))
    scored.sort(key=lambda x: -x[0])
    for total, cl, start, end, resume, gains in scored[:SHOWN_SUGGESTIONS]:
        median_gain = gains[len(gains) // 2]
        s: dict[str, Any] = {
            "kind": "move_volatile_span",
            "start": start,
            "end": end,
            "tokens": end - start,
            "resume_end": resume,
            "pairs": len(cl),
            "unlock_tokens_per_request": median_gain,
            "unlock_tokens_total": total,
        }
        what = f"the {end - start} tokens at {start}..{end}"
        where = f"later, behind the text the requests share after it (to about token {resume})"
        latest = max(cl, key=lambda p: p.t)
        decode = _decoder(decode_for, latest)
        if decode is not None:
            s["span_text"] = decode(_context_slice(latest, start, end))
            bounds = _line_bounds(latest, start, end, decode)
            if bounds is not None:
                s["line_start"], s["line_end"] = bounds
                s["line"] = decode(_context_slice(latest, *bounds)).rstrip("\n")
                what = (
                    f"the line {json.dumps(s['line'], ensure_ascii=False)} (tokens "
                    f"{bounds[0]}..{bounds[1]}; {end - start} of them vary, at {start}..{end})"
                )
            else:
                what += f" ({json.dumps(s['span_text'], ensure_ascii=False)})"
            s["resume_after_text"] = decode(unpack(latest.resume_tail))
            tail = json.dumps("…" + s["resume_after_text"], ensure_ascii=False)
            where += f", which ends {tail}"
        s["message"] = (
            f"move {what} {where}: about {median_gain:,} more reusable tokens per request "
            f"({len(cl)} of {len(pairs)} consecutive pairs agree again after the span)"
        )
        out.append(s)
    keyed = sum(1 for p in pairs if p.key_differs)
    if keyed:
        out.append(
            {
                "kind": "cache_key_differs",
                "pairs": keyed,
                "message": f"{keyed} of {len(pairs)} consecutive pairs carry a different "
                "cache_salt or LoRA adapter: by design they share no cached block, whatever "
                "their tokens (check the salt policy if these should share)",
            }
        )
    reordered = sum(1 for p in pairs if p.tools_reordered)
    if reordered:
        at = Counter(p.index for p in pairs if p.tools_reordered).most_common(1)[0][0]
        out.append(
            {
                "kind": "stable_tool_order",
                "pairs": reordered,
                "index": at,
                "message": f"{reordered} of {len(pairs)} consecutive pairs sent the same tools "
                f"in a different order (first at token {at}): serialize tools in a fixed "
                "order, e.g. sorted by name",
            }
        )
    return out


def _verdict(rep: dict[str, Any]) -> dict[str, Any]:
    """The main cause: the largest of layout / placement / capacity, except that layout only
    counts as the cause when it is fixable (early divergences are common, or a reordering
    would unlock >= 10% of prompt tokens); otherwise the unreusable tokens are new content and
    the larger of placement / capacity is the cause if it costs >= 5%, else it is healthy."""
    lost = rep["tokens"]["lost"]
    n = rep["tokens"]["prompt"]
    if not n:
        return {"cause": "no_data", "message": "no requests in the window"}
    causes = {k: lost[k]["tokens"] for k in ("layout", "placement", "capacity")}
    cause = max(causes, key=lambda k: (causes[k], k == "layout"))
    div = rep["divergence"]
    early_share = div["early_pairs"] / div["pairs"] if div["pairs"] else 0.0
    unlock = sum(s.get("unlock_tokens_total", 0) for s in rep["suggestions"])
    reordered = div["tools_reordered_pairs"] / div["pairs"] if div["pairs"] else 0.0
    fixable = early_share >= 0.25 or unlock >= 0.1 * n or reordered >= 0.25
    if cause == "layout" and not fixable:
        other = max(("placement", "capacity"), key=lambda k: causes[k])
        cause = other if causes[other] >= 0.05 * n else "healthy"
    msg = {
        "layout": f"the prompts break their own prefix: {lost['layout']['share']:.1%} of prompt "
        "tokens are not reusable even by one unlimited cache",
        "placement": f"requests land where their prefix is not: {lost['placement']['share']:.1%}"
        " of prompt tokens were held by another replica than the chosen one",
        "capacity": f"the cache is too small: {lost['capacity']['share']:.1%} of prompt tokens "
        "were reusable and correctly placed but evicted before reuse",
        "healthy": "the cache reuses what the prompts allow; the unreusable tokens are new "
        "content (late divergence), not a broken prefix",
    }[cause]
    if cause == "layout" and rep["suggestions"]:
        msg += f"; {rep['suggestions'][0]['message']}"
    elif cause == "layout" and div["culprits"]:
        c = div["culprits"][0]
        msg += f"; most consecutive requests first differ at token {c['index']}"
    if rep["decode_bound"]["flag"]:
        msg += (
            "; note: decode-bound (completion tokens dwarf prompt tokens), a higher hit rate "
            "will not move latency much"
        )
    return {"cause": cause, "message": msg, "early_divergence_share": round(early_share, 3)}
