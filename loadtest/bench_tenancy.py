"""What each cache_salt policy costs in prefix-cache hit rate, on one multi-tenant workload.

    python -m loadtest.bench_tenancy [--replicas 4] [--conversations 60] [--quick]

Simulated replicas run in a subprocess (``loadtest.procs``); for each scenario a fresh
``prefix-router serve`` subprocess is started with a temporary ``--config`` YAML (and the
replicas' caches are reset), and the load-test harness (``loadtest.runner.run_workload``)
drives the same workload through it, each request carrying its tenant's API key:

- ``passthrough``   auth off, no salts (the baseline: one shared cache for everyone);
- ``none``          auth on, ``salt_policy: none`` for all tenants (shares like passthrough);
- ``tenant``        auth on, ``salt_policy: tenant`` for all;
- ``tenant+client`` auth on, ``salt_policy: tenant+client``; here the clients also send a
                    per-end-user ``cache_salt`` (``--users`` users per tenant);
- ``tenant+public`` ``tenant`` for all, and the tenants that use the published system prompt
                    may share it unsalted (``public_prefixes``).

The workload: ``--tenants`` tenants, the last ``--public-tenants`` of them using one published
system prompt (a marketplace's stock assistant prompt), the others their own; conversations
arrive Poisson and send the server's answers back, as ``loadtest.workloads.multi_tenant``.

Printed per scenario: the fleet hit rate (from the replicas' own counters), the ideal with no
salts (one unlimited shared cache), the ideal under the scenario's salts (the same cache, each
request keyed by the salt the gateway gives it: the policy's own cost, without routing or
eviction losses), TTFT p50/p99 (client-side, streamed), requests ok/sent.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest import benchkit, filler
from loadtest.ideal import IdealRequest, ideal_hit_rate
from loadtest.procs import running, start_gateway, start_replicas, wait_ready
from loadtest.runner import GatewayTarget, RunResult, default_renderer, run_workload
from loadtest.workloads import (
    DEFAULT_MODEL,
    RequestSpec,
    Script,
    Session,
    Workload,
    tenant_system_prompt,
)
from router.config import load_config
from router.tenancy.tenants import Tenancy

SECRET = "bench-tenancy-salt-secret-0123456789abcdef"
SCENARIOS = ("passthrough", "none", "tenant", "tenant+client", "tenant+public")


# ---------------------------------------------------------------------------------------------
# the workload


def public_system_prompt(seed: int, system_words: int) -> str:
    body = tenant_system_prompt(seed + 7919, 0, system_words).split("\n\n", 1)[1]
    return "You are the stock assistant of the Marketplace (published prompt v1).\n\n" + body


def api_key(tenant: str) -> str:
    return f"sk-bench-{tenant}-5f0c2a9e7d1b4c3a"


@dataclass
class Plan:
    tenants: list[str]
    public: set[str]  # tenants using the published system prompt
    public_prompt: str


def tenancy_workload(
    *,
    seed: int = 0,
    tenants: int = 8,
    public_tenants: int = 5,
    conversations: int = 60,
    rate: float = 3.0,
    turns: tuple[int, int] = (2, 4),
    think_time_s: float = 0.5,
    system_words: int = 700,
    user_words: tuple[int, int] = (10, 50),
    max_tokens: int = 32,
    users: int = 0,
    model: str = DEFAULT_MODEL,
) -> tuple[Workload, Plan]:
    """Conversations arrive Poisson at ``rate``/s; each picks a tenant uniformly. Tenants
    ``t{T-P}..t{T-1}`` use the published prompt. ``users`` > 0: each conversation's client
    sends ``cache_salt: user-<k>`` (k = conversation index mod ``users``). Every request
    carries ``Authorization: Bearer <its tenant's key>`` in ``spec.headers``."""
    names = [f"t{i}" for i in range(tenants)]
    public = set(names[tenants - public_tenants :])
    public_prompt = public_system_prompt(seed, system_words)
    prompts = {
        n: public_prompt if n in public else tenant_system_prompt(seed, i, system_words)
        for i, n in enumerate(names)
    }
    arrivals = filler.rng(seed, "bench_tenancy", "arrivals")
    sessions = []
    t_now = 0.0
    for ci in range(conversations):
        tenant = arrivals.choice(names)
        n_turns = arrivals.randint(*turns)
        salt = f"user-{ci % users}" if users else None

        def script(
            ci: int = ci, tenant: str = tenant, n: int = n_turns, salt: Any = salt
        ) -> Script:
            rng = filler.rng(seed, "bench_tenancy", "conv", ci)
            msgs: list[dict[str, Any]] = [{"role": "system", "content": prompts[tenant]}]
            for turn in range(n):
                msgs.append(
                    {"role": "user", "content": filler.question(rng, rng.randint(*user_words))}
                )
                think = rng.expovariate(1.0 / think_time_s) if think_time_s > 0 and turn else 0.0
                body: dict[str, Any] = {
                    "model": model,
                    "messages": list(msgs),
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                if salt:
                    body["cache_salt"] = salt
                answer = yield RequestSpec(
                    "chat",
                    group=tenant,
                    session=f"{tenant}-c{ci}",
                    turn=turn,
                    body=body,
                    delay_s=think,
                    meta={"tenant": tenant},
                    headers={"Authorization": f"Bearer {api_key(tenant)}"},
                )
                if answer is None:
                    return
                msgs.append({"role": "assistant", "content": answer})

        sessions.append(Session(f"{tenant}-c{ci}", tenant, t_now, script, n_turns))
        t_now += arrivals.expovariate(rate)
    workload = Workload(
        "tenancy",
        f"{tenants} tenants ({public_tenants} on one published ~{system_words}-word system "
        f"prompt, the rest on their own), {conversations} conversations of {turns[0]}-{turns[1]} "
        f"turns arriving Poisson at {rate}/s, think time ~Exp({think_time_s} s)"
        + (f", clients send cache_salt per end user ({users} per tenant)" if users else ""),
        sessions,
        model,
        params=dict(
            seed=seed,
            tenants=tenants,
            public_tenants=public_tenants,
            conversations=conversations,
            rate=rate,
            turns=list(turns),
            think_time_s=think_time_s,
            system_words=system_words,
            max_tokens=max_tokens,
            users=users,
        ),
    )
    return workload, Plan(names, public, public_prompt)


# ---------------------------------------------------------------------------------------------
# per-request headers for the harness


# ---------------------------------------------------------------------------------------------
# scenarios


def write_files(tmp: Path, plan: Plan, scenario: str) -> Path:
    """The api_keys_file (shared by all scenarios) and this scenario's --config YAML."""
    keys = tmp / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "salt_secrets": [{"secret": SECRET, "not_before": 0, "epoch": "1"}],
                "public_prefixes": {"marketplace": plan.public_prompt},
                "tenants": {t: {"keys": [api_key(t)]} for t in plan.tenants},
            },
            sort_keys=False,
        )
    )
    config: dict[str, Any] = {"log_level": "warning"}
    if scenario == "passthrough":
        config.update(auth=False)
    else:
        policy = "tenant" if scenario == "tenant+public" else scenario
        # The runner reads which replica answered from the decision headers (off by
        # default with auth on).
        config.update(auth=True, api_keys_file=str(keys), salt_policy=policy, decision_headers=True)
        if scenario == "tenant+public":
            config["tenants"] = {t: {"public_prefixes": ["marketplace"]} for t in plan.public}
    path = tmp / f"gateway-{scenario.replace('+', '_')}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def ideal_with(
    result: RunResult, renderer: Any, salt_of: Callable[[RequestSpec], str | None]
) -> float | None:
    """The ideal hit rate of the run's successful requests, each keyed by ``salt_of``."""
    reqs = []
    for r in result.records:
        if not r.ok or r.spec is None:
            continue
        ids = r.spec.prompt_token_ids(renderer)
        out = renderer.encode(r.answer, add_special_tokens=False) if r.answer else []
        reqs.append(IdealRequest(r.sent_s or 0.0, ids, r.end_s, out, salt_of(r.spec)))
    return ideal_hit_rate(reqs, result.block_size).hit_rate


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.post(u + "/reset_prefix_cache") as resp:
                resp.raise_for_status()


async def run_scenario(
    scenario: str, replica_urls: list[str], tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    users = args.users if scenario == "tenant+client" else 0
    workload, plan = tenancy_workload(
        seed=args.seed,
        tenants=args.tenants,
        public_tenants=args.public_tenants,
        conversations=args.conversations,
        rate=args.rate,
        users=users,
    )
    config_path = write_files(tmp, plan, scenario)
    await reset_caches(replica_urls)
    with running() as procs:
        gw = start_gateway(replica_urls, "--config", str(config_path))
        procs.append(gw)
        await wait_ready(gw.url, "/ready")
        result = await run_workload(
            GatewayTarget(gw.url, replica_urls, policy="ttft", name=scenario),
            workload,
            concurrency=args.concurrency,
            max_seconds=args.max_seconds,
            compute_ideal=False,
            progress=False,
            label=scenario,
        )
    # The salts the gateway gave each request, decided by the same code from the same config.
    tenancy = Tenancy(load_config(None, env={"PREFIX_ROUTER_CONFIG": str(config_path)}), env={})
    renderer = default_renderer()

    def policy_salt(spec: RequestSpec) -> str | None:
        body = spec.make_body()
        return tenancy.salt(spec.meta["tenant"], body.get("cache_salt"), body["messages"]).salt

    ideal_open = await asyncio.to_thread(ideal_with, result, renderer, lambda spec: None)
    ideal_policy = await asyncio.to_thread(ideal_with, result, renderer, policy_salt)
    ttft = result.ttft
    return {
        "scenario": scenario,
        "fleet_hit_rate": result.fleet_hit_rate,
        "ideal_no_salts": ideal_open,
        "ideal_under_policy": ideal_policy,
        "ttft_p50_ms": ttft.get("p50", math.nan) * 1000,
        "ttft_p99_ms": ttft.get("p99", math.nan) * 1000,
        "ok": result.ok,
        "sent": result.sent,
        "errors": result.errors_by_status,
        "workload": workload.description,
    }


def pct(v: float | None) -> str:
    return benchkit.pct(v, sep=" ")


def table(rows: list[dict[str, Any]]) -> str:
    return benchkit.markdown(
        "policy | fleet hit rate | ideal, no salts | ideal under the policy | TTFT p50 | "
        "TTFT p99 | ok / sent",
        (
            (
                f"`{r['scenario']}`",
                pct(r["fleet_hit_rate"]),
                pct(r["ideal_no_salts"]),
                pct(r["ideal_under_policy"]),
                f"{r['ttft_p50_ms']:.0f} ms",
                f"{r['ttft_p99_ms']:.0f} ms",
                f"{r['ok']} / {r['sent']}",
            )
            for r in rows
        ),
    )


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    scenarios = benchkit.subset(args.scenarios, list(SCENARIOS), "scenario")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tenancy-") as tmp, running() as procs:
        sim = start_replicas(
            args.replicas,
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
            "--prefill-tokens-per-s",
            str(args.prefill_tokens_per_s),
        )
        procs.append(sim)
        for scenario in scenarios:
            row = await run_scenario(scenario, sim.urls, Path(tmp), args)
            rows.append(row)
            benchkit.progress(
                f"{scenario}: fleet {pct(row['fleet_hit_rate'])}, ideal "
                f"{pct(row['ideal_no_salts'])} / under policy {pct(row['ideal_under_policy'])}, "
                f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, "
                f"{row['ok']}/{row['sent']} ok {row['errors'] or ''}"
            )
    print(f"Workload: {rows[0]['workload']}.")
    print(
        f"{args.replicas} simulated replicas ({args.num_gpu_blocks} blocks of 16 tokens each, "
        f"prefill {args.prefill_tokens_per_s:.0f} tokens/s), gateway policy ttft, "
        f"concurrency {args.concurrency}, seed {args.seed}.\n"
    )
    print(table(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = benchkit.parser(
        "loadtest.bench_tenancy", __doc__, seed=0, quick="20 conversations (a smoke run)", json=True
    )
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--public-tenants", type=int, default=5, help="tenants on the published prompt")
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--rate", type=float, default=3.0, help="conversation arrivals per second")
    p.add_argument("--users", type=int, default=3, help="end users per tenant (tenant+client)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV blocks per replica")
    p.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    benchkit.add_subset(p, "--scenarios", list(SCENARIOS))
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.rate = 20, 5.0
    rows = asyncio.run(amain(args))
    benchkit.write_json(args.json, rows)
    return 1 if any(r["ok"] != r["sent"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
