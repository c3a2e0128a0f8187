"""``prefix-router loadtest``: run, compare, sim (the examples are its --help epilog)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtest import workloads as wl
from loadtest.report import failure_line, summary_table, write_report
from loadtest.runner import (
    CLIENT_POLICIES,
    GATEWAY_POLICIES,
    ClientTarget,
    GatewayTarget,
    RunResult,
    Target,
    run_workload,
    start_target,
)
from router.ops.command_line import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    at_least,
    check_file,
    positive,
)

EXAMPLES = """\
examples:

    # a gateway in front of three replicas (their /metrics give the fleet hit rate)
    prefix-router loadtest run --workload multi_tenant --gateway http://127.0.0.1:8000 \\
        --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \\
        --replica http://127.0.0.1:8003 --max-seconds 60 --out reports/mt

    # the same replicas addressed directly, client-side round robin
    prefix-router loadtest run --workload multi_tenant --policy round_robin \\
        --replica http://127.0.0.1:8001,http://127.0.0.1:8002,http://127.0.0.1:8003

    # fresh simulated replicas per policy, same workload and seed through each gateway
    prefix-router loadtest compare --workload preamble --position all --policies round_robin \\
        --sim 3 --out reports/preamble
    prefix-router loadtest compare --workload trace --policies ring_spill,round_robin --sim 4 \\
        --time-scale 20 --max-requests 400

    # existing targets (share one set of replicas: later runs start warm)
    prefix-router loadtest compare --workload multi_tenant \\
        --targets gw=http://127.0.0.1:8000,rr=replicas:round_robin --replica URL ...

    # start simulated replicas and keep them up (same as prefix-router replica)
    prefix-router loadtest sim --port 9001 --count 3
"""


def _split(values: Sequence[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition("-")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"bad range {text!r}")
    return lo, hi


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=True, choices=wl.WORKLOADS)
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the workload and of random client-side policies (default 0)",
    )
    g.add_argument("--model", default=wl.DEFAULT_MODEL, help="model name sent in requests")
    g.add_argument(
        "--position",
        default=None,
        help="preamble: first, after_system or last (compare: a comma list or all)",
    )
    g.add_argument("--conversations", type=int, help="preamble / multi_tenant: conversations")
    g.add_argument("--turns", type=_range, help="preamble: N turns; multi_tenant, agentic: MIN-MAX")
    g.add_argument(
        "--system-words",
        type=int,
        help="preamble / multi_tenant: words of system prompt (about 1.2 tokens each)",
    )
    g.add_argument("--max-tokens", type=int, help="preamble / multi_tenant: max_tokens per turn")
    g.add_argument(
        "--think-time",
        type=float,
        help="preamble / multi_tenant: seconds between "
        "turns (multi_tenant: mean of an exponential)",
    )
    g.add_argument("--tenants", type=int, help="multi_tenant, agentic: number of tenants")
    g.add_argument(
        "--tenant-skew", type=float, help="multi_tenant, agentic: Zipf exponent (0 = uniform)"
    )
    g.add_argument(
        "--rate",
        type=float,
        help="multi_tenant: conversations/s; agentic: sessions/s; prefix_repetition: requests/s "
        "(inf = all at once)",
    )
    g.add_argument(
        "--trace",
        help="trace: a Mooncake-format JSON-lines file (default: the "
        "bundled first 3,000 rows of the Mooncake conversation trace)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        help="trace, agentic, sessions: time compression (10 = 10x faster)",
    )
    g.add_argument("--max-output-tokens", type=int, help="trace: cap on max_tokens (default 128)")
    g.add_argument("--max-input-tokens", type=int, help="trace: skip longer rows (default 40000)")
    g.add_argument(
        "--sessions",
        help="sessions: a JSON-lines file of recorded agent sessions (the format, and how to "
        "convert a Mooncake trace: docs/load-testing.md)",
    )
    g.add_argument("--agent-sessions", type=int, help="agentic: sessions (default 24)")
    g.add_argument(
        "--context-cap",
        type=int,
        help="agentic: estimated tokens past which an agent compacts its context (100000)",
    )
    g.add_argument(
        "--subagent-share",
        type=float,
        help="agentic: share of turns that fork a sub-agent first (default 0.15)",
    )
    g.add_argument(
        "--messages-share",
        type=float,
        help="agentic: share of sessions that speak Anthropic's Messages API through the "
        "anthropic SDK (default 0.25; the others: OpenAI chat completions)",
    )
    g.add_argument("--num-prefixes", type=int, help="prefix_repetition: prefixes (default 10)")
    g.add_argument("--suffixes-per-prefix", type=int, help="prefix_repetition: default 8")
    g.add_argument("--prefix-len", type=int, help="prefix_repetition: tokens (default 256)")
    g.add_argument("--suffix-len", type=int, help="prefix_repetition: tokens (default 256)")
    g.add_argument("--output-len", type=int, help="prefix_repetition: max_tokens (default 32)")

    b = p.add_argument_group("bounds and output")
    b.add_argument("--max-requests", type=int, default=None, help="stop sending after N requests")
    b.add_argument(
        "--max-seconds",
        type=float,
        default=120.0,
        help="send nothing after this many seconds (default 120); in-flight requests are drained",
    )
    b.add_argument("--concurrency", type=int, default=16, help="max requests in flight (16)")
    b.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s (60)")
    b.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT)")
    b.add_argument("--no-ideal", action="store_true", help="skip the ideal hit rate")
    b.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block size for the ideal (default: the replicas' vllm:cache_config_info, else 16)",
    )
    b.add_argument("--out", default=None, help="report directory (default reports/<name>-<time>)")
    b.add_argument("--title", default=None, help="report title")
    b.add_argument("--quiet", action="store_true", help="no progress bar, no table on stdout")

    s = p.add_argument_group("simulated replicas (--sim N)")
    s.add_argument(
        "--sim",
        type=int,
        default=None,
        metavar="N",
        help="start N fresh simulated vLLM replicas for each run (loopback)",
    )
    s.add_argument(
        "--sim-instant",
        action="store_true",
        help="simulated replicas answer without modelled prefill/decode time",
    )
    s.add_argument("--sim-prefill-tps", type=float, help="prefill tokens/s (default 200000)")
    s.add_argument("--sim-decode-tps", type=float, help="decode tokens/s (default 2000)")
    s.add_argument(
        "--sim-decode-cost",
        type=float,
        help="prefill tokens of replica time per output token (decode load; default 0)",
    )
    s.add_argument(
        "--sim-gpu-blocks",
        type=int,
        help="KV blocks per replica (default 4096; agentic and sessions: 32768, 512k tokens)",
    )
    s.add_argument(
        "--sim-max-model-len",
        type=int,
        help="the replicas' context (default 40960; agentic and sessions: 131072, above the "
        "context cap)",
    )
    s.add_argument("--sim-block-size", type=int, help="block size (default 16)")
    s.add_argument(
        "--processes",
        action="store_true",
        help="compare: run the simulated replicas and each gateway in their own processes, as "
        "deployed, so the harness's own CPU does not slow them (recommended for TTFT figures)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="prefix-router loadtest",
        description="Load tests for prefix-router: workloads, trace "
        "replay, fleet hit rate from the replicas' counters vs the ideal, TTFT, balance.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="run one workload against one target", formatter_class=HelpFormatter
    )
    _add_common(run)
    t = run.add_argument_group("target")
    t.add_argument(
        "--gateway",
        help="gateway URL (otherwise the replicas are addressed directly with --policy)",
    )
    t.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="replica base URL (repeatable or comma-separated): where /metrics is "
        "read; with no --gateway, where requests go",
    )
    t.add_argument(
        "--policy",
        default="round_robin",
        choices=CLIENT_POLICIES,
        help="client-side policy without --gateway (default round_robin)",
    )
    t.add_argument("--label", default=None, help="name of the run in the report")

    cmp_ = sub.add_parser(
        "compare",
        help="run the same workload and seed through several "
        "targets or policies; one table, one set of plots",
        formatter_class=HelpFormatter,
    )
    _add_common(cmp_)
    t = cmp_.add_argument_group("targets")
    t.add_argument(
        "--policies",
        default=None,
        help="comma list; each gets fresh simulated replicas (--sim N) and a fresh gateway "
        f"running that policy ({', '.join(GATEWAY_POLICIES)}), or, for client:round_robin "
        "and client:random, no gateway: the harness addresses the replicas itself",
    )
    t.add_argument(
        "--targets",
        default=None,
        help="comma list of NAME=URL (a gateway) or NAME=replicas:POLICY (the "
        "--replica URLs, client-side); run in order on the same replicas",
    )
    t.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="replica base URLs for --targets",
    )

    sub.add_parser(
        "sim",
        help="run simulated vLLM replicas (same as prefix-router replica; see sim --help)",
        add_help=False,
    )
    return parser


# ---------------------------------------------------------------------------------------------


def workload_kwargs(args: argparse.Namespace, position: str | None = None) -> dict[str, Any]:
    """The chosen workload's constructor arguments from the flags that were given."""
    name = args.workload
    kw: dict[str, Any] = {"seed": args.seed, "model": args.model}

    def put(key: str, value: Any) -> None:
        if value is not None:
            kw[key] = value

    if name == "preamble":
        put("position", position or args.position or "last")
        put("conversations", args.conversations)
        put("turns", args.turns[1] if args.turns else None)
        put("system_words", args.system_words)
        put("max_tokens", args.max_tokens)
        put("think_time_s", args.think_time)
    elif name == "multi_tenant":
        put("tenants", args.tenants)
        put("conversations", args.conversations)
        put("rate", args.rate)
        put("turns", args.turns)
        put("think_time_s", args.think_time)
        put("system_words", args.system_words)
        put("max_tokens", args.max_tokens)
        put("tenant_skew", args.tenant_skew)
    elif name == "trace":
        put("path", args.trace)
        put("time_scale", args.time_scale)
        put("max_output_tokens", args.max_output_tokens)
        put("max_input_tokens", args.max_input_tokens)
        put("max_requests", args.max_requests)
    elif name == "pressure":
        put("tenants", args.tenants)
        put("conversations", args.conversations)
        put("rate", args.rate)
        put("tenant_skew", args.tenant_skew)
    elif name == "agentic":
        put("sessions", args.agent_sessions)
        put("tenants", args.tenants)
        put("tenant_skew", args.tenant_skew)
        put("rate", args.rate)
        put("turns", args.turns)
        put("think_time_s", args.think_time)
        put("system_words", args.system_words)
        put("context_cap_tokens", args.context_cap)
        put("subagent_share", args.subagent_share)
        put("messages_share", args.messages_share)
        put("time_scale", args.time_scale)
    elif name == "sessions":
        put("path", args.sessions)
        put("time_scale", args.time_scale)
    elif name == "prefix_repetition":
        put("num_prefixes", args.num_prefixes)
        put("suffixes_per_prefix", args.suffixes_per_prefix)
        put("prefix_len", args.prefix_len)
        put("suffix_len", args.suffix_len)
        put("output_len", args.output_len)
        put("rate", args.rate)
    return kw


def _positions(args: argparse.Namespace) -> list[str | None]:
    if args.workload != "preamble":
        if args.position:
            raise UsageError("--position applies to the preamble workload only")
        return [None]
    if not args.position:
        return ["last"]
    if args.position == "all":
        return list(wl.PREAMBLE_POSITIONS)
    pos = _split([args.position])
    bad = [p for p in pos if p not in wl.PREAMBLE_POSITIONS]
    if bad:
        raise UsageError(f"unknown preamble position(s) {bad}; use first, after_system, last")
    return list(pos)


LONG_CONTEXT_WORKLOADS = ("agentic", "sessions")


def sim_overrides(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if getattr(args, "sim_instant", False):
        kw["instant"] = True
    for flag, key in (
        ("sim_prefill_tps", "prefill_tokens_per_s"),
        ("sim_decode_tps", "decode_tokens_per_s"),
        ("sim_decode_cost", "decode_cost_tokens"),
        ("sim_gpu_blocks", "num_gpu_blocks"),
        ("sim_block_size", "block_size"),
        ("sim_max_model_len", "max_model_len"),
    ):
        v = getattr(args, flag, None)
        if v is not None:
            kw[key] = v
    if getattr(args, "workload", None) in LONG_CONTEXT_WORKLOADS:
        # Agent contexts grow to the cap (100k tokens): replicas that can hold them, as a
        # vLLM server for agents is configured (Qwen3 is served up to 131072 with YaRN).
        kw.setdefault("max_model_len", 131_072)
        kw.setdefault("num_gpu_blocks", 32_768)
    return kw


@contextlib.asynccontextmanager
async def simulated_replicas(
    n: int, *, seed: int = 0, **overrides: Any
) -> AsyncIterator[list[str]]:
    """Start ``n`` fresh simulated replicas on loopback; yields their base URLs."""
    from loadtest.replica import SimConfig, run_replicas

    async with run_replicas(n, SimConfig(seed=seed), **overrides) as reps:
        yield [r.url for r in reps]


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    if args.out:
        return Path(args.out)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{name}-{args.workload}-{stamp}"


async def _run_one(
    target: Target, args: argparse.Namespace, position: str | None, label: str
) -> RunResult:
    workload = wl.build(args.workload, **workload_kwargs(args, position))
    return await run_workload(
        target,
        workload,
        concurrency=args.concurrency,
        max_requests=args.max_requests,
        max_seconds=args.max_seconds,
        request_timeout_s=args.timeout,
        seed=args.seed,
        stream=not args.no_stream,
        progress=False if args.quiet else None,
        label=label,
        compute_ideal=not args.no_ideal,
        block_size=args.block_size,
    )


def check_args(args: argparse.Namespace) -> None:
    """Bounds, files and policy names checked before any replica starts (UsageError)."""
    at_least("--concurrency", args.concurrency, 1)
    at_least("--max-requests", args.max_requests, 1)
    positive("--max-seconds", args.max_seconds)
    positive("--timeout", args.timeout)
    at_least("--sim", args.sim, 1)
    at_least("--block-size", args.block_size, 1)
    at_least("--sim-block-size", args.sim_block_size, 1)
    at_least("--sim-gpu-blocks", args.sim_gpu_blocks, 1)
    at_least("--sim-max-model-len", args.sim_max_model_len, 1)
    positive("--sim-prefill-tps", args.sim_prefill_tps)
    positive("--sim-decode-tps", args.sim_decode_tps)
    at_least("--sim-decode-cost", args.sim_decode_cost, 0)
    for flag in ("conversations", "tenants", "system_words", "max_tokens", "num_prefixes"):
        at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    positive("--rate", args.rate)
    positive("--time-scale", args.time_scale)
    if args.trace is not None and args.workload != "trace":
        raise UsageError("--trace applies to --workload trace only")
    check_file("--trace", args.trace)
    known = set(GATEWAY_POLICIES) | {f"client:{p}" for p in CLIENT_POLICIES}
    for policy in _split([getattr(args, "policies", None) or ""]):
        if policy not in known:
            raise UsageError(
                f"--policies: unknown policy {policy!r}; choose from {', '.join(sorted(known))}"
            )
    for url in [*_split(args.replica), *([args.gateway] if getattr(args, "gateway", None) else [])]:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"{url!r} is not a URL: give http://HOST:PORT")


async def check_reachable(urls: Sequence[tuple[str, str]]) -> None:
    """Each ``(flag, url)`` answers HTTP at all, before a run spends its minutes sending
    requests nowhere (any status will do: only the connection is checked)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for flag, url in urls:
            try:
                async with s.get(url.rstrip("/") + "/health") as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                cause = type(e).__name__ if isinstance(e, asyncio.TimeoutError) else str(e)
                raise UsageError(
                    f"cannot reach {flag} {url} ({cause}): start it, or fix {flag}"
                ) from None


async def _cmd_run(args: argparse.Namespace) -> list[RunResult]:
    replicas = _split(args.replica)
    positions = _positions(args)
    if len(positions) != 1:
        raise UsageError("run takes one --position; use compare for several")
    if args.sim:
        if args.gateway or replicas:
            raise UsageError("--sim starts its own replicas; drop --gateway/--replica")
        async with simulated_replicas(args.sim, seed=args.seed, **sim_overrides(args)) as urls:
            target = ClientTarget(urls, args.policy, seed=args.seed)
            return [await _run_one(target, args, positions[0], args.label or target.name)]
    if not replicas:
        raise UsageError(
            "give the replicas with --replica URL (their /metrics are read; "
            "without --gateway requests go to them), or --sim N"
        )
    await check_reachable(
        [
            *([("--gateway", args.gateway)] if args.gateway else []),
            *[("--replica", u) for u in replicas],
        ]
    )
    target = (
        GatewayTarget(args.gateway, replicas)
        if args.gateway
        else ClientTarget(replicas, args.policy, seed=args.seed)
    )
    return [await _run_one(target, args, positions[0], args.label or target.name)]


def parse_targets(spec: str, replicas: list[str], seed: int) -> list[Target]:
    targets: list[Target] = []
    for item in _split([spec]):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--targets item {item!r}: expected NAME=URL or NAME=replicas:POLICY")
        if value.startswith("replicas:"):
            if not replicas:
                raise UsageError(f"--targets {name}: needs --replica URLs")
            targets.append(ClientTarget(replicas, value.split(":", 1)[1], seed=seed, name=name))
        elif value.startswith(("http://", "https://")):
            targets.append(GatewayTarget(value, replicas, name=name, policy=name))
        else:
            raise UsageError(f"--targets {name}: {value!r} is neither a URL nor replicas:POLICY")
    return targets


async def _cmd_compare(args: argparse.Namespace) -> list[RunResult]:
    positions = _positions(args)
    results: list[RunResult] = []

    def label(base: str, pos: str | None) -> str:
        return f"{base}/{pos}" if pos and len(positions) > 1 else base

    if args.targets:
        if args.policies:
            raise UsageError("give --policies or --targets, not both")
        replicas = _split(args.replica)
        targets = parse_targets(args.targets, replicas, args.seed)
        await check_reachable(
            [("--replica", u) for u in replicas]
            + [("--targets", t.url) for t in targets if isinstance(t, GatewayTarget)]
        )
        for pos in positions:
            for t in targets:
                results.append(await _run_one(t, args, pos, label(t.name, pos)))
        return results
    policies = _split([args.policies or ""])
    if not policies:
        raise UsageError("compare needs --policies a,b (with --sim N) or --targets")
    n = args.sim or 3
    if args.processes:
        return await _compare_in_processes(args, policies, positions, n, label)
    for pos in positions:
        for policy in policies:
            async with simulated_replicas(n, seed=args.seed, **sim_overrides(args)) as urls:
                target, stop = await start_target(policy, urls, seed=args.seed)
                try:
                    results.append(await _run_one(target, args, pos, label(target.name, pos)))
                finally:
                    await stop()
    return results


async def _compare_in_processes(
    args: argparse.Namespace,
    policies: list[str],
    positions: list[str | None],
    n: int,
    label: Any,
) -> list[RunResult]:
    """``compare --processes``: fresh replica and gateway processes (loadtest.procs) per run."""
    from loadtest import procs

    flags = {
        "prefill_tokens_per_s": "--prefill-tokens-per-s",
        "decode_tokens_per_s": "--decode-tokens-per-s",
        "decode_cost_tokens": "--decode-cost-tokens",
        "num_gpu_blocks": "--num-gpu-blocks",
        "block_size": "--block-size",
    }
    sim_args: list[str] = ["--seed", str(args.seed)]
    for key, value in sim_overrides(args).items():
        sim_args += ["--instant"] if key == "instant" else [flags[key], str(value)]
    results: list[RunResult] = []
    for pos in positions:
        for policy in policies:
            with procs.running() as running:
                replicas = procs.start_replicas(n, *sim_args)
                running.append(replicas)
                if policy.startswith("client:"):
                    base = policy.split(":", 1)[1]
                    target: Target = ClientTarget(
                        replicas.urls, base, seed=args.seed, name=f"{base} (client)"
                    )
                else:
                    gw = procs.start_gateway(replicas.urls, "--policy", policy)
                    running.append(gw)
                    await procs.wait_ready(gw.url, proc=gw)
                    target = GatewayTarget(gw.url, replicas.urls, policy=policy, name=policy)
                results.append(await _run_one(target, args, pos, label(target.name, pos)))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from loadtest.replica import main as replica_main

        return replica_main(argv[1:], prog="prefix-router loadtest sim")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        results = asyncio.run(_cmd_run(args) if args.command == "run" else _cmd_compare(args))
    except UsageError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    out = write_report(
        results,
        _out_dir(args, args.command),
        title=args.title,
        command=shlex.join(["prefix-router", "loadtest", *argv]),
    )
    failures = failure_line(results)  # 4xx, 5xx, broken or lost: the run is not a result
    if failures:
        print(failures, file=sys.stderr, flush=True)
    if not args.quiet:
        print(summary_table(results))
        print(f"\nreport: {out / 'summary.md'}")
    return 1 if failures else 0
