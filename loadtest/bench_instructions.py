"""Instructions per request, per step, of the gateway's request path, in one process.

    python -m loadtest.bench_instructions [--requests 30] [--baseline REF]

Drives ``prepare -> plan (decide) -> record -> learn`` (no HTTP, no sockets: the steps the
gateway runs for a request between reading its body and writing it out, plus learning from
the answer) for the fresh-user-turn mix of ``loadtest.bench_overhead --fresh-user-turn``: ~6,100-
token chats whose ~3,000-token system prompt repeats and whose user turn is new every time.

It runs itself under valgrind's callgrind, which counts instructions: unlike wall-clock time,
the count is the same run after run whatever else the machine does. Each step is wrapped so
that entering and leaving it calls ``os.getppid()``; callgrind is started with
``--dump-before=getppid``, so every interval between two steps' edges lands in its own dump,
and the dumps are summed per step (the marker's own cost, measured on empty intervals, is
taken off). ``--baseline REF`` also measures the tree of git revision REF (same driver, same
bodies) and prints both side by side: the before/after of a change in one command.
Without valgrind it falls back to ``time.perf_counter_ns`` (noisy; the table says so).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

MODEL = "Qwen/Qwen3-0.6B"
REPLICAS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
# Steps, in the order printed. Each is (label, module, attribute path); an attribute a tree
# does not have (an older or newer revision) is skipped, and its cost lands in the enclosing
# step. Nested steps take their time out of the enclosing one. The request path moved from
# router.gateway.Gateway to router.request_path.RequestPath, then to
# router.routing.request_path.RequestPath (issue 40's folders): all are listed.
STEPS: list[tuple[str, str, str]] = [
    ("prepare (rest)", "router.gateway", "Gateway.prepare"),
    ("prepare (rest)", "router.request_path", "RequestPath.prepare"),
    ("prepare (rest)", "router.routing.request_path", "RequestPath.prepare"),
    ("parse + limits", "router.gateway", "parse_body"),
    ("parse + limits", "router.request_path", "parse_body"),
    ("parse + limits", "router.routing.request_path", "parse_body"),
    ("parse + limits", "router.routing.prepare", "parse_body"),
    ("normalise", "router.prompt.renderer", "Renderer.normalize_chat"),
    ("render (jinja)", "router.prompt.renderer", "Renderer._render"),
    ("prefix state", "router.prompt.renderer", "Renderer._prefix_ids"),
    ("lazy.head", "router.prompt.lazy", "head"),
    ("segment tokenize", "router.prompt.limits", "PromptLimits.tokenize_text"),
    ("block hashes", "router.gateway", "Gateway._hashes"),
    ("block hashes", "router.request_path", "RequestPath._hashes"),
    ("block hashes", "router.routing.request_path", "RequestPath._hashes"),
    ("decide", "router.gateway", "Gateway.decide"),
    ("decide", "router.request_path", "RequestPath.decide"),
    ("decide", "router.request_path", "RequestPath.plan"),
    ("decide", "router.routing.request_path", "RequestPath.decide"),
    ("decide", "router.routing.request_path", "RequestPath.plan"),
    ("index record", "router.gateway", "Gateway.record_placement"),
    ("index record", "router.request_path", "RequestPath.record_placement"),
    ("index record", "router.routing.request_path", "RequestPath.record_placement"),
    ("learn", "router.gateway", "Gateway._learn"),
    ("learn", "router.request_path", "RequestPath._learn"),
    ("learn", "router.routing.request_path", "RequestPath._learn"),
    ("learn", "router.learning", "Learner.learn"),
    ("learn", "router.routing.learning", "Learner.learn"),
]
OUTSIDE = "driver (not counted)"
MARKER = "marker"

_labels: list[str] = []
_stack: list[str] = [OUTSIDE]
_on = False
_ns: dict[str, int] = defaultdict(int)  # without valgrind: wall-clock per step
_last = [0]


def _mark() -> None:
    """Close the interval running now (its label: the innermost step) and open the next."""
    if _on:
        now = time.perf_counter_ns()
        _ns[_stack[-1]] += now - _last[0]
        _labels.append(_stack[-1])
        os.getppid()  # callgrind dumps before this call (--dump-before=getppid)
        _last[0] = time.perf_counter_ns()


def _wrap(label: str, fn: Any) -> Any:
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapped(*args: Any, **kwargs: Any) -> Any:
            _mark()
            _stack.append(label)
            try:
                return await fn(*args, **kwargs)
            finally:
                _mark()
                _stack.pop()

        return awrapped

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark()
        _stack.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            _mark()
            _stack.pop()

    return wrapped


def _instrument() -> list[str]:
    import importlib

    found = []
    for label, module, path in STEPS:
        *parents, name = path.split(".")
        try:
            owner: Any = importlib.import_module(module)
            for p in parents:
                owner = getattr(owner, p)
            fn = getattr(owner, name)
        except (AttributeError, ImportError):
            continue
        setattr(owner, name, _wrap(label, fn))
        found.append(label)
    return found


def _bodies(n: int, seed: int) -> list[bytes]:
    from loadtest.bench_overhead import make_bodies

    return make_bodies(n, 4000, 3000, False, seed, False, fresh_user=True)


def _first(*candidates: tuple[str, str]) -> Any:
    """The first of (module, name) that this tree has: a --baseline tree may predate a move."""
    import importlib

    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError:
            continue
    raise ImportError(f"none of {candidates}")


async def _gateway() -> Any:
    from router.config import Config
    from router.gateway import Gateway

    Fleet = _first(("router.fleet.replicas", "Fleet"), ("router.fleet", "Fleet"))
    load_renderer = _first(
        ("router.models.loading", "load_renderer"), ("router.loading", "load_renderer")
    )

    if hasattr(Config, "from_flat"):  # the config in typed sections
        config = Config.from_flat({"replicas": list(REPLICAS)})
    else:  # a --baseline tree from before it
        config = Config(replicas=list(REPLICAS))
    gw = Gateway(config, load_renderer(None, MODEL))
    # The fleet view without its health loop or a session: every replica up, serving MODEL.
    fleet = Fleet(REPLICAS, None)  # type: ignore[arg-type]
    for r in fleet.replicas.values():
        r.models = {MODEL: None}
        r.cards = {MODEL: {"id": MODEL, "max_model_len": 40960}}
        r.models_known = True
    if hasattr(gw, "wiring"):  # the gateway split: the wiring holds the fleet
        gw.wiring._fleet = fleet
    else:
        gw.fleet = fleet
    if hasattr(gw, "_load_models"):  # the per-model registry: each model's renderer
        await gw._load_models()
    (gw.wiring if hasattr(gw, "wiring") else gw).sync_ring()
    gw.renderer.max_chars_per_token()
    return gw


async def _drive(gw: Any, raw: bytes, i: int) -> None:
    Outcome = _first(("router.upstream.proxy", "Outcome"), ("router.forward", "Outcome"))

    path = getattr(gw, "path", gw)  # the request path, split out of the gateway
    rr = await path.prepare(raw, {}, "chat", f"req-{i}", None, lazy=True)
    if hasattr(path, "plan"):  # the exchange plans (a decision is the plan's one leg)
        decision = (await path.plan(rr)).legs[0].decision
    else:
        decision = await path.decide(rr)
    path.policy.placed(decision)
    await path.record_placement(rr, decision)
    if hasattr(path, "count_prompt"):  # before the exchange counted the prompt itself
        path.count_prompt(rr)
    cached = decision.matched_blocks * rr.block_size
    path.learn(rr, decision, Outcome(200, 0.001, cached, 1, True))
    await asyncio.sleep(0)  # anything the request left for the loop


async def _child(a: argparse.Namespace) -> dict[str, Any]:
    global _on
    found = _instrument()
    gw = await _gateway()
    bodies = _bodies(a.warmup + a.requests, a.seed)
    for i in range(a.warmup):
        await _drive(gw, bodies[i], i)
    gc.collect()
    n_empty = 40
    _on = True
    _mark()  # closes start-up and warm-up
    for i in range(a.warmup, a.warmup + a.requests):
        await _drive(gw, bodies[i], i)
    _stack.append(MARKER)
    for _ in range(n_empty):
        _mark()
    _stack.pop()
    _mark()
    _on = False
    ids = Renderer_of(gw).tokenize_chat(json.loads(bodies[-1]))
    return {
        "labels": _labels,
        "found": found,
        "requests": a.requests,
        "tokens": len(ids),
        "chars": len(bodies[-1]),
        "t_steps": {k: v for k, v in _ns.items() if k not in (OUTSIDE, MARKER)},
    }


def Renderer_of(gw: Any) -> Any:  # noqa: N802 - the renderer that served the model
    models = getattr(gw, "models", None)
    entry = models.default() if models is not None and hasattr(models, "default") else None
    return entry.renderer if entry is not None and entry.renderer is not None else gw.renderer


def _dump_totals(directory: Path) -> list[int]:
    """The instruction count of each numbered callgrind dump, in order."""
    files = []
    for p in directory.glob("callgrind.out.*"):
        m = re.fullmatch(r"callgrind\.out\.\d+\.(\d+)", p.name)
        if m:
            files.append((int(m.group(1)), p))
    out = []
    for _, p in sorted(files):
        total = 0
        with p.open() as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
                    break
        out.append(total)
    return out


def _per_step(labels: list[str], totals: list[int]) -> tuple[dict[str, float], float]:
    """Instructions per step (summed), the marker's own cost per interval taken off."""
    # Dump k closes the interval labels[k - 1] names (dump 1: start-up and warm-up).
    pairs = list(zip(labels, totals, strict=False))
    empty = sorted(t for label, t in pairs if label == MARKER)
    overhead = float(empty[len(empty) // 2]) if empty else 0.0
    sums: dict[str, float] = defaultdict(float)
    for label, t in pairs:
        if label not in (MARKER, OUTSIDE):
            sums[label] += max(0.0, t - overhead)
    return dict(sums), overhead


def _measure(tree: Path | None, a: argparse.Namespace, use_valgrind: bool) -> dict[str, Any]:
    """Run the driver (this file) against ``tree`` (None: this checkout) in a subprocess."""
    here = Path(__file__).resolve()
    env = dict(os.environ, PYTHONHASHSEED="0", PREFIX_ROUTER_LOG_LEVEL="WARNING")
    root = tree or here.parent.parent
    env["PYTHONPATH"] = str(root)
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(here), "--child", str(out)]
        cmd += ["--requests", str(a.requests), "--warmup", str(a.warmup), "--seed", str(a.seed)]
        if use_valgrind:
            cmd = [
                "valgrind",
                "--tool=callgrind",
                "--dump-before=getppid",
                "--dump-instr=no",
                f"--callgrind-out-file={tmp}/callgrind.out.%p",
                *cmd,
            ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"the driver failed (exit status {proc.returncode})")
        result = json.loads(out.read_text())
        result["seconds"] = time.perf_counter() - t0
        if use_valgrind:
            totals = _dump_totals(Path(tmp))
            result["steps"], result["marker"] = _per_step(result["labels"], totals)
        else:
            result["steps"], result["marker"] = result["t_steps"], 0.0
        return result


def _export(ref: str) -> Path:
    root = Path(__file__).resolve().parent.parent
    dest = Path(tempfile.mkdtemp(prefix="bench-instr-base-"))
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _print(results: list[tuple[str, dict[str, Any]]], unit: str) -> None:
    from loadtest import benchkit  # here: the child runs with older trees on its path

    labels = list(dict.fromkeys(s[0] for s in STEPS))
    n_req = results[0][1]["requests"]
    first = results[0][1]
    print(
        f"\n{n_req} requests measured: fresh-user-turn chats, ~{first['tokens']:,} tokens "
        f"({first['chars']:,}-byte bodies), system prompt repeated, new user turn"
    )
    table = benchkit.Text([(unit + " per request", 26)] + [(n[:22], 24) for n, _ in results])
    print(table.head())
    totals = [0.0] * len(results)
    for label in labels:
        row: list[object] = [label]
        for k, (_, r) in enumerate(results):
            v = r["steps"].get(label)
            if v is None and label not in r["found"]:
                row.append("-")
                continue
            per = (v or 0.0) / n_req
            totals[k] += per
            row.append(f"{per:,.0f}")
        print(table.row(row))
    print(table.head().splitlines()[1])
    print(table.row(["total", *(f"{t:,.0f}" for t in totals)]))
    if len(results) > 1:
        fewer = [benchkit.ratio(totals[0], t, digits=2) for t in totals]
        print(table.row(["x fewer than " + results[0][0][:13], *fewer]))
    for name, r in results:
        print(
            f"{name}: marker cost {r['marker']:,.0f} per interval taken off; "
            f"{r['seconds']:.0f} s under the counter"
        )


def main(argv: list[str] | None = None) -> int:
    # Not loadtest.benchkit's parser: this file is also the child run against --baseline
    # trees (PYTHONPATH), which may predate benchkit.
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=30, help="requests measured")
    p.add_argument("--warmup", type=int, default=20, help="requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        metavar="REF",
        action="append",
        default=[],
        help="also measure git revision REF (repeatable); printed first",
    )
    p.add_argument("--time", action="store_true", help="wall-clock instead of valgrind")
    p.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        result = asyncio.run(_child(a))
        Path(a.child).write_text(json.dumps(result))
        return 0
    use_valgrind = not a.time and shutil.which("valgrind") is not None
    if not use_valgrind and not a.time:
        print("valgrind not found: timing instead (noisy)", file=sys.stderr)
    results = []
    for ref in a.baseline:
        tree = _export(ref)
        try:
            print(f"measuring {ref} ...", file=sys.stderr)
            results.append((ref, _measure(tree, a, use_valgrind)))
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    print("measuring this checkout ...", file=sys.stderr)
    results.append(("this checkout", _measure(None, a, use_valgrind)))
    _print(results, "instructions" if use_valgrind else "ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
