"""The report as text, for a terminal (``format=text``, ``prefix-router diagnose``)."""

from __future__ import annotations

import json
from typing import Any


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.1%}"


def render_text(rep: dict[str, Any]) -> str:
    sc, hr, tk = rep["scope"], rep["hit_rates"], rep["tokens"]
    lines = []
    label = ", ".join(f"{k} {sc[k]}" for k in ("model", "tenant", "app") if sc.get(k))
    lines.append(
        f"prefix-cache diagnosis{' — ' + label if label else ''}: {sc['requests']} requests, "
        f"{sc['prompt_tokens']:,} prompt tokens"
        + (f" over {sc['window_s']:.1f} s" if sc.get("window_s") is not None else "")
        + f", block size "
        f"{sc['block_size']}{' (redacted)' if sc['redacted'] else ''}"
    )
    lines.append("")
    rc = hr.get("replica_counters")
    lines.append(
        f"hit rate   ideal {_pct(hr['ideal'])}   available {_pct(hr['available'])}   captured "
        f"{_pct(hr['captured'])}   delivered {_pct(hr['delivered'])} "
        f"({hr['delivered_requests']} requests)"
        + (f"   replica counters {_pct(rc['hit_rate'])}" if rc else "")
    )
    lines.append("")
    lines.append("where the prompt tokens went")
    n = max(tk["prompt"], 1)
    rows = [("delivered (cached)", tk["delivered"], "reported by the replicas")]
    rows += [
        ("lost to prompt layout", tk["lost"]["layout"]["tokens"], "not reusable by any cache"),
        ("lost to placement", tk["lost"]["placement"]["tokens"], "another replica held it"),
        ("lost to capacity", tk["lost"]["capacity"]["tokens"], "evicted before reuse"),
    ]
    if tk["unreported"]["tokens"]:
        rows.append(
            (
                "reusable, unreported",
                tk["unreported"]["tokens"],
                "no cached_tokens to compare (offline, or not reported)",
            )
        )
    for name, v, why in rows:
        lines.append(f"  {name:<22} {v:>10,} {v / n:6.1%}  {why}".rstrip())
    if tk["beyond_ideal"]:
        lines.append(f"  (of the cached, {tk['beyond_ideal']:,} beyond the window's ideal)")
    sp = rep["index_spills"]
    if sp["requests"]:
        lines.append(
            f"  index spills: {sp['requests']} requests went to a replica believed to hold "
            f"{sp['tokens']:,} tokens less than another (load)"
        )
    v = rep["verdict"]
    lines.append("")
    lines.append(f"verdict: {v['cause']} — {v['message']}")
    div = rep["divergence"]
    lines.append("")
    lines.append(
        f"first divergence between consecutive requests of a group ({div['pairs']} pairs, "
        f"{div['early_pairs']} early, median token {div['median_index']})"
    )
    top = max((b["count"] for b in div["buckets"]), default=0) or 1
    for b in div["buckets"]:
        bar = "#" * round(40 * b["count"] / top)
        lines.append(f"  tokens {b['range']:<10} {b['count']:>5}  {bar}".rstrip())
    for i, c in enumerate(div["culprits"], 1):
        lines.append("")
        lines.append(
            f"culprit {i}: {c['pairs']} pairs ({c['early_pairs']} early) in tokens {c['bucket']}, "
            f"{c['pairs_at_index']} at token {c['index']} (block {c['block']} + "
            f"{c['offset_in_block']}), ~{c['median_tokens_after']:,} tokens lost behind it"
            + (f" [{', '.join(c['kind'])}]" if c.get("kind") else "")
        )
        if "line" in c:
            lines.append(f"  line      {json.dumps(c['line'], ensure_ascii=False)}")
            lines.append(f"  previous  {json.dumps(c['previous_line'], ensure_ascii=False)}")
            lines.append(f"  before    {json.dumps(c['before'][-80:], ensure_ascii=False)}")
            lines.append(f"  after     {json.dumps(c['after_current'][:80], ensure_ascii=False)}")
            lines.append(f"  vs        {json.dumps(c['after_previous'][:80], ensure_ascii=False)}")
    if rep["suggestions"]:
        lines.append("")
        lines.append("suggestions")
        for s in rep["suggestions"]:
            lines.append(f"  - {s['message']}")
    db = rep["decode_bound"]
    lines.append("")
    lines.append(
        f"decode-bound: {'YES' if db['flag'] else 'no'} ({db['basis']}: ratio {db['ratio']} "
        f"of prompt tokens, threshold {db['threshold']})"
    )
    if len(rep["groups"]) > 1:
        lines.append("")
        lines.append("groups (model / tenant / app: requests)")
        for g in rep["groups"]:
            lines.append(f"  {g['model']} / {g['tenant']} / {g['app'] or '-'}: {g['requests']}")
    return "\n".join(line.rstrip() for line in lines) + "\n"
