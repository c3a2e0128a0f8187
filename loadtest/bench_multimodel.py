"""Two models behind one gateway: per model, the fleet hit rate against the ideal.

    python -m loadtest.bench_multimodel                      # ~1 minute
    python -m loadtest.bench_multimodel --conversations 60 --max-seconds 90
    python -m loadtest.bench_multimodel --gateways 2         # fleet mode on a throwaway Redis

Starts in this process simulated replicas of two tokenizer families -- Qwen3 (the bundled
tokenizer, block size 16) and Llama 3 (block size 32; the test tokenizer fetched by
tools/fetch_test_tokenizers.py, or ``--llama-tokenizer DIR``) -- and one gateway with no
tokenizer flags: it finds Qwen3's tokenizer bundled and Llama 3's in a Hugging Face cache laid
out in a temporary directory (HF_HUB_CACHE), as on a host where the model was downloaded. Each
model gets its own multi-tenant chat workload (``loadtest.workloads.multi_tenant``), both run at
once. Prints per model: requests, the fleet hit rate (its replicas' own counters), the ideal
hit rate (one unlimited cache over the same token ids, with that model's tokenizer and block
size), their ratio, and the gateway's predicted vs reported cached tokens for the model.

``--gateways N`` runs N gateways in fleet mode on one throwaway redis-server (or
``--redis-url``), each listing the replicas with another model first (the order a gateway sees
models in must not matter), every request sent to a random gateway; the predicted and
reported cached tokens are summed over the gateways.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import aiohttp

from loadtest import benchkit, workloads
from loadtest.bench_fleet import MultiGatewayTarget, redis_server
from loadtest.metrics_scrape import parse_prometheus
from loadtest.runner import RunResult, run_workload
from loadtest.sim.config import SimConfig
from loadtest.sim.server import SimReplica
from loadtest.sim.tokens import get_renderer
from router.config import load_config
from router.core.bundled import tokenizer_dir
from router.http.app import RunningGateway, start_gateway

QWEN = "Qwen/Qwen3-0.6B"
LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"


def default_llama_dir() -> Path:
    root = os.environ.get("PREFIX_ROUTER_TEST_TOKENIZERS")
    base = Path(root) if root else Path.home() / ".cache" / "prefix-router" / "test-tokenizers"
    return base / "llama3"


def hf_cache(root: Path, repo: str, files: Path) -> Path:
    """``repo``'s tokenizer files in a hub cache laid out as huggingface_hub lays it out."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / "0000000000000000000000000000000000000000"
    snap.mkdir(parents=True)
    for f in files.iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f.resolve())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(snap.name)
    return root


async def run(a: argparse.Namespace) -> int:
    llama_dir = Path(a.llama_tokenizer or default_llama_dir())
    if not (llama_dir / "tokenizer.json").is_file():
        print(f"no Llama 3 tokenizer at {llama_dir}: python tools/fetch_test_tokenizers.py")
        return 2
    plan = {
        QWEN: (str(tokenizer_dir()), 16),
        LLAMA: (str(llama_dir), 32),
    }
    replicas: dict[str, list[SimReplica]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_HUB_CACHE"] = str(hf_cache(Path(tmp), LLAMA, llama_dir))
        try:
            for model, (tok, bs) in plan.items():
                for _ in range(a.replicas):
                    cfg = SimConfig(
                        model=model, tokenizer=tok, block_size=bs, num_gpu_blocks=a.num_gpu_blocks
                    )
                    r = SimReplica(cfg)
                    await r.start()
                    replicas.setdefault(model, []).append(r)
            # No tokenizer flags; --wrong-tokenizer: Llama hashed with Qwen's (the old bug).
            models = {LLAMA: {"tokenizer": plan[QWEN][0]}} if a.wrong_tokenizer else {}
            order = list(plan)
            with contextlib.ExitStack() as stack:
                fleet: dict[str, object] = {}
                if a.gateways > 1:
                    fleet = {"redis_url": stack.enter_context(redis_server(a.redis_url))}
                gws: list[RunningGateway] = []
                try:
                    for g in range(a.gateways):
                        first = order[g % len(order) :] + order[: g % len(order)]
                        urls = [r.url for m in first for r in sorted(replicas[m], key=_url)]
                        config = load_config(None, env={}, replicas=urls, models=models, **fleet)
                        gws.append(await start_gateway(config, port=0))
                    jobs = []
                    for i, model in enumerate(plan):
                        wl = workloads.multi_tenant(
                            seed=a.seed + i,
                            conversations=a.conversations,
                            rate=a.rate,
                            model=model,
                        )
                        target = MultiGatewayTarget(
                            [gw.url for gw in gws],
                            [r.url for r in replicas[model]],
                            seed=a.seed + i,
                            name=model,
                        )
                        jobs.append(
                            run_workload(
                                target,
                                wl,
                                concurrency=a.concurrency,
                                max_seconds=a.max_seconds,
                                renderer=get_renderer(plan[model][0]),
                                block_size=plan[model][1],
                                label=model,
                                progress=False,
                            )
                        )
                    results: list[RunResult] = await asyncio.gather(*jobs)
                    scraped = []
                    async with aiohttp.ClientSession() as s:
                        for gw in gws:
                            async with s.get(gw.url + "/metrics") as resp:
                                scraped.append(parse_prometheus(await resp.text()))
                    drifting = sorted(
                        {
                            n
                            for gw in gws
                            for n, e in gw.gateway.models.entries.items()
                            if e.drift.flagged
                        }
                    )
                finally:
                    for gw in gws:
                        await gw.stop()
        finally:
            for rs in replicas.values():
                for r in rs:
                    await r.stop()
    print(f"gateways: {a.gateways}" + (" (fleet mode, one Redis)" if a.gateways > 1 else ""))
    cells = []
    for model, res in zip(plan, results, strict=True):
        pred = sum(
            _sample(m, "prefix_router_model_predicted_cached_tokens_total", model) for m in scraped
        )
        rep = sum(
            _sample(m, "prefix_router_model_reported_cached_tokens_total", model) for m in scraped
        )
        f, i = res.fleet_hit_rate, res.ideal_hit_rate
        cells.append(
            (
                model,
                plan[model][1],
                f"{res.ok}/{res.sent}",
                benchkit.pct(f),
                benchkit.pct(i),
                benchkit.ratio(f, i),
                f"{pred:,.0f} / {rep:,.0f}",
            )
        )
        for w in res.warnings:
            benchkit.progress(f"  warning ({model}): {w}")
    headers = "model | block size | requests ok | fleet hit rate | ideal | fleet / ideal | "
    print(benchkit.markdown(headers + "predicted / reported cached tokens", cells))
    print(f"drift watch flagged: {', '.join(drifting) or 'none'}")
    return 0


def _url(r: SimReplica) -> str:
    return r.url


def _sample(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, model: str) -> float:
    return sum(v for labels, v in metrics.get(name, []) if labels.get("model") == model)


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser("loadtest.bench_multimodel", __doc__, seed=0)
    p.add_argument("--replicas", type=int, default=2, help="replicas per model")
    p.add_argument("--conversations", type=int, default=40, help="per model")
    p.add_argument("--rate", type=float, default=2.0, help="conversations per second, per model")
    p.add_argument("--concurrency", type=int, default=16, help="per model")
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--llama-tokenizer", default=None)
    p.add_argument(
        "--wrong-tokenizer",
        action="store_true",
        help="configure Qwen3's tokenizer for the Llama model (what a single-tokenizer gateway "
        "does): its predictions, the drift watch and its hit rate then show the cost",
    )
    p.add_argument("--gateways", type=int, default=1, help="gateways; above 1, in fleet mode")
    p.add_argument("--redis-url", default=None, help="fleet mode's Redis (default: a throwaway)")
    a = p.parse_args(argv)
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
