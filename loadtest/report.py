"""Write a run's (or a comparison's) report directory.

``write_report(results, out_dir)`` writes:

- ``summary.md``: one table over all runs (fleet hit rate from the replicas' counters, ideal
  hit rate, their ratio, TTFT / end-to-end percentiles, load balance, errors, lost requests),
  a per-replica table per run, warnings and the plots;
- ``summary.json``: the same figures, machine-readable;
- ``requests.jsonl``: one JSON object per request (field ``run`` = the run's label);
- ``ttft_cdf.png`` (TTFT and end-to-end latency CDFs per run), ``hit_rate_per_replica.png``,
  ``timeline.png`` (per request: send time vs the replica that served it, coloured by prefix
  group; one panel per run).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtest.runner import RunResult, percentiles


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(d: dict[str, float], key: str) -> str:
    v = d.get(key)
    return "n/a" if v is None else f"{1000 * v:.1f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _short(url: str) -> str:
    return url.replace("http://", "").replace("https://", "")


def failure_line(results: Sequence[RunResult]) -> str | None:
    """One line saying how many requests failed and why (the commonest reasons first), or
    None when every sent request completed."""
    failed = [r for res in results for r in res.failed]
    if not failed:
        return None
    sent = sum(res.sent for res in results)
    reasons: Counter[str] = Counter()
    for r in failed:
        if r.status is None:
            kind = f"lost ({(r.error or 'no response').split(':')[0]})"
        elif r.status != 200:
            kind = f"HTTP {r.status}"
        else:
            kind = "broken stream"
        why = (r.error or "").strip().splitlines()[0][:120] if r.error else ""
        reasons[f"{kind}: {why}" if why and r.status is not None else kind] += 1
    shown = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
    more = f"; {len(reasons) - 3} other reasons" if len(reasons) > 3 else ""
    return f"error: {len(failed)} of {sent} requests failed: {shown}{more}"


def summary_table(results: Sequence[RunResult]) -> str:
    head = (
        "| run | sent | ok | lost | errors | fleet hit | ideal hit | fleet/ideal | "
        "TTFT p50 ms | p90 | p99 | E2E p50 ms | p90 | p99 | req max/mean | "
        "prefill max/mean | req/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        b = r.balance()
        errs = ", ".join(f"{k}: {v}" for k, v in r.errors_by_status.items()) or "0"
        t, e = r.ttft, r.latency
        lines.append(
            f"| {r.label} | {r.sent} | {r.ok} | {r.lost} | {errs} | {_pct(r.fleet_hit_rate)} | "
            f"{_pct(r.ideal_hit_rate)} | {_num(r.hit_ratio)} | {_ms(t, 'p50')} | "
            f"{_ms(t, 'p90')} | {_ms(t, 'p99')} | {_ms(e, 'p50')} | {_ms(e, 'p90')} | "
            f"{_ms(e, 'p99')} | {_num(b['requests_max_over_mean'])} | "
            f"{_num(b['prefill_max_over_mean'])} | {r.throughput_rps:.1f} |"
        )
    return "\n".join(lines)


def pd_table(results: Sequence[RunResult]) -> str:
    """P/D columns: the requests the gateway gave a prefill leg (its
    ``x-prefix-router-prefill-replica`` header), over how many prefill replicas, and their
    TTFT beside the requests served without one."""
    head = "| run | with a prefill leg | prefill replicas | TTFT p50 ms split | unsplit |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ok = [x for x in r.records if x.ok]
        split = [x for x in ok if x.prefill_replica]
        share = len(split) / len(ok) if ok else None

        def p50(recs: list[Any]) -> str:
            ttfts = sorted(t for x in recs if (t := x.ttft_s) is not None)
            return f"{1000 * ttfts[len(ttfts) // 2]:.1f}" if ttfts else "-"

        rest = [x for x in ok if not x.prefill_replica]
        replicas = len({x.prefill_replica for x in split})
        lines.append(
            f"| {r.label} | {len(split)} ({_pct(share)}) | {replicas} | {p50(split)} | "
            f"{p50(rest)} |"
        )
    return "\n".join(lines)


def replica_table(r: RunResult) -> str:
    lines = [
        "| replica | requests | hit rate | queried tokens | hit tokens | prefilled tokens |",
        "|---|---|---|---|---|---|",
    ]
    for row in r.replica_rows():
        lines.append(
            f"| {_short(row.url)} | {row.requests} | {_pct(row.hit_rate)} | "
            f"{row.queries:,.0f} | {row.hits:,.0f} | {row.prefilled_tokens:,.0f} |"
            if row.metrics_ok
            else f"| {_short(row.url)} | {row.requests} | n/a (no metrics) | | | |"
        )
    return "\n".join(lines)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that is running, as it could be typed again (the program by its name)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name
        if argv[0] in ("__main__.py", "-c"):
            argv[0] = "python -m loadtest"
    return shlex.join(argv)


def version_line() -> str:
    """prefix-router's version, the checkout's commit when it is one, and Python's."""
    from router import __version__

    commit = ""
    root = Path(__file__).resolve().parent.parent
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if done.returncode == 0 and done.stdout.strip():
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            commit = f" (commit {done.stdout.strip()}{', modified' if dirty else ''})"
    return f"prefix-router {__version__}{commit}, Python {platform.python_version()}"


def reuse_line(counters: dict[str, float]) -> str | None:
    """The gateway's reuse over the run: what the fleet held, what routing captured, what the
    engines delivered, and the prompt tokens recomputed because a request went where its
    prefix was not (available - captured)."""
    if not all(f"reuse:{k}" in counters for k in ("prompt", "available", "captured")):
        return None
    prompt, available = counters["reuse:prompt"], counters["reuse:available"]
    captured, delivered = counters["reuse:captured"], counters.get("reuse:delivered")
    if prompt <= 0 or available <= 0:  # nothing held, or a policy that never reads the index
        return None
    left = max(0.0, available - captured)
    return (
        f"Reuse (the gateway's counters, prompt tokens): available in the fleet {available:,.0f} "
        f"({available / prompt:.1%}), captured by routing {captured:,.0f} ({captured / prompt:.1%})"
        + (f", delivered by the replicas {delivered:,.0f}" if delivered is not None else "")
        + f"; recomputed because of where requests went: {left:,.0f} ({left / prompt:.1%})."
    )


def placement_lines(r: RunResult) -> list[str]:
    """Where each prefix group went: its replica set, and (through a gateway) the decisions
    and spills behind it. What explains a replica far above the mean load."""
    sets = r.replica_sets()
    if not sets:
        return []
    total = sum(sum(c.values()) for c in sets.values())
    sizes = Counter(len(c) for c in sets.values())
    out = [
        f"Replica sets: {len(sets)} prefix groups; "
        + ", ".join(
            f"{n} served by {k} replica{'s' if k > 1 else ''}" for k, n in sorted(sizes.items())
        )
        + "."
    ]
    if r.gateway_counters:
        decisions = {
            k.split(":", 1)[1]: v
            for k, v in r.gateway_counters.items()
            if k.startswith("decisions:")
        }
        spills = {
            k.split(":", 1)[1]: v for k, v in r.gateway_counters.items() if k.startswith("spills:")
        }
        if decisions:
            out.append(
                "Gateway decisions by reason: "
                + ", ".join(f"{k or '-'} {v:.0f}" for k, v in sorted(decisions.items()) if v)
                + "."
            )
        out.append(
            "Spills (placed away from the longest prefix holder): "
            + (", ".join(f"{k} {v:.0f}" for k, v in sorted(spills.items()) if v) or "none")
            + "."
        )
        if (line := reuse_line(r.gateway_counters)) is not None:
            out.append(line)
    out += ["", "| group | requests | share | replicas (requests) |", "|---|---|---|---|"]
    hottest = sorted(sets.items(), key=lambda kv: -sum(kv[1].values()))[:8]
    for group, c in hottest:
        n = sum(c.values())
        served = ", ".join(f"{_short(u)} ({k})" for u, k in c.most_common())
        out.append(f"| {group} | {n} | {n / total:.0%} | {served} |")
    out += ["", "| replica | requests | groups | hottest group's share |", "|---|---|---|---|"]
    per_replica: dict[str, Counter[str]] = {}
    for group, c in sets.items():
        for url, k in c.items():
            per_replica.setdefault(url, Counter())[group] += k
    for url, groups in sorted(per_replica.items()):
        n = sum(groups.values())
        group, top = groups.most_common(1)[0]
        out.append(f"| {_short(url)} | {n} | {len(groups)} | {top / n:.0%} ({group}) |")
    return out


CONTEXT_BUCKETS = (4_096, 16_384, 32_768, 65_536)  # prompt tokens: upper bounds, then more
TURN_BUCKETS = (1, 4, 10)  # a session's request index: 0, 1-3, 4-9, 10 and later


def _bucket_label(bounds: Sequence[int], i: int, unit: str) -> str:
    lo = bounds[i - 1] if i else 0
    if i == len(bounds):
        return f">= {lo:,}{unit}"
    hi = bounds[i] - 1
    return f"{lo:,}{unit}" if lo == hi else f"{lo:,}-{hi:,}{unit}"


def ttft_by(results: Sequence[RunResult], key: str) -> str | None:
    """TTFT p50 / p99 (ms) and requests per run, bucketed by the prompt's size (``key``
    "context") or by the request's index in its session ("turn"); None when no run has
    sessions of more than one request (nothing to bucket)."""
    if not any(rec.turn > 0 for r in results for rec in r.records):
        return None
    bounds = CONTEXT_BUCKETS if key == "context" else TURN_BUCKETS
    unit = " tokens" if key == "context" else ""

    def bucket(rec: Any) -> int | None:
        value = rec.prompt_tokens if key == "context" else rec.turn
        if value is None:
            return None
        return next((i for i, b in enumerate(bounds) if value < b), len(bounds))

    head = "prompt" if key == "context" else "request in session"
    rows = [f"| run | {head} | requests | TTFT p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for r in results:
        groups: dict[int, list[float]] = {}
        for rec in r.records:
            b = bucket(rec)
            if rec.ok and rec.ttft_s is not None and b is not None:
                groups.setdefault(b, []).append(rec.ttft_s)
        for b in sorted(groups):
            pc = percentiles(groups[b], (50, 99))
            rows.append(
                f"| {r.label} | {_bucket_label(bounds, b, unit)} | {len(groups[b])} | "
                f"{pc['p50'] * 1000:.1f} | {pc['p99'] * 1000:.1f} |"
            )
    return "\n".join(rows)


def render_summary(
    results: Sequence[RunResult],
    *,
    title: str | None = None,
    plots: Sequence[str] = (),
    notes: Sequence[str] = (),
    command: str | None = None,
) -> str:
    first = results[0]
    workloads = list(dict.fromkeys(r.workload for r in results))
    out = [f"# Load test: {title or ', '.join(workloads)}", ""]
    out.append(
        f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} by {version_line()}."
    )
    out += ["", "```", command if command is not None else command_line(), "```", ""]
    descs = dict.fromkeys(r.workload_description for r in results)
    for d in descs:
        out.append(f"- Workload: {d}")
    out.append(
        f"- Seed {first.seed}; concurrency {first.concurrency}; max requests "
        f"{first.max_requests if first.max_requests is not None else 'all'}; max "
        f"{first.max_seconds:g} s; {'streaming' if first.stream else 'non-streaming'}; "
        f"block size {first.block_size}."
    )
    for r in results:
        out.append(
            f"- `{r.label}`: {r.target}; workload `{r.workload}`; "
            f"{r.duration_s:.1f} s from {r.started_at}; sent {r.sent}: {r.stop_description()}; "
            f"the load generator's process used {r.client_cpu_s:.1f} s of CPU "
            f"({r.client_cpu_s / r.duration_s if r.duration_s > 0 else 0:.0%} of a core)."
        )
    out.extend(f"- {n}" for n in notes)
    warns = dict.fromkeys(w for r in results for w in r.warnings)
    if warns:
        out.append("")
        for w in warns:
            out.append(f"> **Warning:** {w}")
            out.append(">")
        out.pop()
    out += ["", "## Results", "", summary_table(results), ""]
    out.append(
        "fleet hit = Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` summed "
        "over the replicas' own counters during the run (tokens). ideal hit = the same requests' "
        "token ids, in send order, through one unlimited cache with vLLM's rules (full blocks "
        "from block 0, hit capped at num_tokens − 1, answers cached at completion). TTFT is "
        "measured client-side (first streamed token). lost = sent − any HTTP response; it must "
        "be 0. max/mean = the busiest replica's share over the average (1.00 = even)."
    )
    client = [r for r in results if r.client_hit_rate is not None]
    if client:
        out += [
            "",
            "Client-reported hit rate (Σ usage cached_tokens / Σ prompt_tokens): "
            + ", ".join(f"`{r.label}` {_pct(r.client_hit_rate)}" for r in client)
            + ".",
        ]
    disaggregated = [r for r in results if any(x.prefill_replica for x in r.records)]
    if disaggregated:
        out += ["", "## Prefill/decode disaggregation", "", pd_table(disaggregated)]
    if results[0].stream:
        for key, title in (("context", "TTFT by prompt size"), ("turn", "TTFT by turn")):
            table = ttft_by(results, key)
            if table is not None:
                out += ["", f"## {title}", "", table]
    out += ["", "## Per replica", ""]
    for r in results:
        out += [f"### {r.label}", "", replica_table(r), ""]
        placement = placement_lines(r)
        if placement:
            out += placement + [""]
    errs = [r for r in results if r.errors_by_status]
    if errs:
        out += ["## Errors", ""]
        for r in errs:
            samples = dict.fromkeys(x.error for x in r.records if x.error)
            out.append(
                f"- `{r.label}`: {r.errors_by_status}; e.g. "
                + "; ".join(f"`{s}`" for s in list(samples)[:3])
            )
        out.append("")
    if plots:
        out += ["## Plots", ""]
        out += [f"![{p}]({p})" for p in plots]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(results: Sequence[RunResult], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, attr, title in (
        (axes[0], "ttft_s", "Time to first token (client-side)"),
        (axes[1], "latency_s", "End-to-end latency"),
    ):
        for r in results:
            vals = sorted(
                1000 * getattr(x, attr) for x in r.records if x.ok and getattr(x, attr) is not None
            )
            if not vals:
                continue
            ys = [(i + 1) / len(vals) for i in range(len(vals))]
            ax.step(vals, ys, where="post", label=f"{r.label} (n={len(vals)})")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.set_xscale("log")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rates(results: Sequence[RunResult], path: Path) -> None:
    plt = _plt()
    n_rep = max((len(r.replica_rows()) for r in results), default=0)
    fig, ax = plt.subplots(
        figsize=(max(8.0, 1.0 * n_rep * max(1, len(results)) + 2), 4.5 + 0.25 * len(results))
    )
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        rows = r.replica_rows()
        xs = [i + k * width for i in range(len(rows))]
        ys = [100 * (row.hit_rate or 0.0) for row in rows]
        lab = f"{r.label}: fleet {_pct(r.fleet_hit_rate)}, ideal {_pct(r.ideal_hit_rate)}"
        bars = ax.bar(xs, ys, width, label=lab)
        ax.bar_label(
            bars,
            labels=[
                f"{y:.0f}%" if row.metrics_ok else "n/a" for y, row in zip(ys, rows, strict=True)
            ],
            fontsize=7,
        )
        if r.ideal_hit_rate is not None:
            ax.hlines(
                100 * r.ideal_hit_rate,
                xs[0] - width / 2 if xs else 0,
                xs[-1] + width / 2 if xs else 1,
                colors=bars.patches[0].get_facecolor() if bars.patches else "k",
                linestyles="dashed",
                linewidth=1,
            )
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(n_rep)])
    ax.set_xticklabels([f"replica {i}" for i in range(n_rep)])
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title("Hit rate per replica (bars; dashed = ideal)")
    ax.legend(
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=1 if len(results) > 3 else len(results),
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(results: Sequence[RunResult], path: Path, *, max_colours: int = 10) -> None:
    """Send time x serving replica per request, coloured by prefix group. With more than
    ``max_colours`` groups only the busiest ``max_colours`` get colours (and the legend); the
    rest are small grey dots."""
    plt = _plt()
    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.2 + 1.6 * n), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, r in zip(axes[:, 0], results, strict=True):
        replicas = [row.url for row in r.replica_rows()]
        idx = {u: i for i, u in enumerate(replicas)}
        sent = [x for x in r.records if x.sent_s is not None]
        counts = Counter(x.group for x in sent)
        top = [g for g, _ in counts.most_common(max_colours)]
        colour = {g: cmap(i % 10) for i, g in enumerate(top)}
        unserved = any((x.replica or "").rstrip("/") not in idx for x in sent)
        offset = 1 if unserved else 0
        grey = [x for x in sent if x.group not in colour]
        if grey:
            ax.scatter(
                [x.sent_s for x in grey],
                [idx.get((x.replica or "").rstrip("/"), -1) + offset for x in grey],
                s=5,
                color="0.75",
                label=f"other groups ({len(counts) - len(top)})",
            )
        for g in top:
            xs = [x for x in sent if x.group == g]
            ax.scatter(
                [x.sent_s for x in xs],
                [idx.get((x.replica or "").rstrip("/"), -1) + offset for x in xs],
                s=16,
                color=colour[g],
                label=f"{g} ({counts[g]})",
            )
        labels = [f"r{i} {_short(u)}" for i, u in enumerate(replicas)]
        ax.set_yticks(range(len(replicas) + offset))
        ax.set_yticklabels((["no response"] if unserved else []) + labels, fontsize=7)
        ax.set_ylim(-0.5, len(replicas) + offset - 0.5)
        busiest = " (colours: the 10 busiest)" if len(counts) > max_colours else ""
        ax.set_title(
            f"{r.label}: replica serving each request, colour = prefix group; "
            f"{len(counts)} groups{busiest}",
            fontsize=9,
        )
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[-1, 0].set_xlabel("send time (s from start)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_by_context(results: Sequence[RunResult], path: Path) -> None:
    """TTFT against the prompt's size: where a long context recomputed on the wrong replica
    shows (agent sessions' later turns)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        pts = [
            (x.prompt_tokens, 1000 * x.ttft_s)
            for x in r.records
            if x.ok and x.prompt_tokens and x.ttft_s is not None
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=8, alpha=0.5, label=f"{r.label} (n={len(pts)})")
    ax.set_title("Time to first token by prompt size")
    ax.set_xlabel("prompt tokens (the replica's usage)")
    ax.set_ylabel("TTFT ms (client-side)")
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HIT_WINDOW = 50  # requests per point of the hit rate over time


def plot_hit_rate_over_time(results: Sequence[RunResult], path: Path) -> None:
    """The replicas' reported hit rate (cached / prompt tokens of the answers) over the run,
    ``HIT_WINDOW`` requests a point, beside the ideal of the same requests: a policy that
    keeps up shows the gap staying flat as sessions come and go."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        recs = [
            x
            for x in r.records
            if x.ok and x.prompt_tokens and x.cached_tokens is not None and x.sent_s is not None
        ]
        recs.sort(key=lambda x: x.sent_s or 0.0)
        xs, ys, ideal = [], [], []
        for i in range(0, len(recs) - HIT_WINDOW + 1, max(1, HIT_WINDOW // 2)):
            win = recs[i : i + HIT_WINDOW]
            prompt = sum(x.prompt_tokens or 0 for x in win)
            xs.append(win[-1].sent_s)
            ys.append(100 * sum(x.cached_tokens or 0 for x in win) / prompt)
            if all(x.ideal_cached_tokens is not None for x in win):
                ideal.append(100 * sum(x.ideal_cached_tokens or 0 for x in win) / prompt)
        if xs:
            line = ax.plot(xs, ys, label=r.label)[0]
            if len(ideal) == len(xs):
                ax.plot(xs, ideal, "--", color=line.get_color(), alpha=0.6)
    ax.set_title(f"Hit rate over time ({HIT_WINDOW} requests a point; dashed = ideal)")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("cached / prompt tokens (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {
    "ttft_cdf.png": plot_cdfs,
    "hit_rate_per_replica.png": plot_hit_rates,
    "timeline.png": plot_timeline,
    "ttft_by_context.png": plot_ttft_by_context,
    "hit_rate_over_time.png": plot_hit_rate_over_time,
}


def write_report(
    results: Sequence[RunResult],
    out_dir: str | Path,
    *,
    title: str | None = None,
    notes: Sequence[str] = (),
    plots: bool = True,
    command: str | None = None,
) -> Path:
    """Write the report directory for ``results`` (one run, or several to compare)."""
    if not results:
        raise ValueError("no results to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "requests.jsonl").open("w") as f:
        for r in results:
            for rec in r.records:
                f.write(json.dumps({"run": r.label, **rec.to_json()}) + "\n")
    (out / "summary.json").write_text(
        json.dumps({"runs": [r.summary() for r in results]}, indent=2, default=str) + "\n"
    )
    made = []
    if plots:
        for name, fn in PLOTS.items():
            fn(results, out / name)
            made.append(name)
    (out / "summary.md").write_text(
        render_summary(results, title=title, plots=made, notes=notes, command=command) + "\n"
    )
    return out
