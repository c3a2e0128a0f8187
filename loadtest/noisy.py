"""The ``noisy_neighbour`` workload: quiet tenants at a steady rate, and one tenant flooding
open-loop for a while at many times a quiet tenant's rate (issue 32).

Every request is a one-shot token-id prompt on /v1/completions: its tenant's system prompt
(cached after the first contact) and a question of its own (uncached), ``X-Tenant`` naming
the tenant and ``user`` one of the tenant's end users (a session inside the tenant). Arrivals
are Poisson and open-loop (nobody waits for an answer before sending the next), so a slow
fleet does not slow the offered load down. The flood runs from ``before_s`` for
``flood_s`` seconds; the quiet tenants run from 0 to ``before_s + flood_s + after_s``. The
quiet tenants' arrivals do not depend on the flood's parameters: the same seed gives the
same quiet requests with and without a flood.

Sizing: with every request costing about ``question_tokens`` of prefill, the quiet tenants
offer ``quiet_tenants x quiet_rate x question_tokens`` tokens/s and the flood
``flood_factor`` times one quiet tenant's share of that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from loadtest.spec import DEFAULT_MODEL, Session, Workload, one_shot

TOKEN_RANGE = (1000, 100_000)
TENANT_HEADER = "X-Tenant"
FLOODER = "flood"


@dataclass(frozen=True)
class NoisyParams:
    seed: int = 0
    quiet_tenants: int = 7
    quiet_rate: float = 1.0  # requests per second per quiet tenant
    flood_factor: float = 30.0  # the flooder's rate, in quiet tenants' rates (0: no flood)
    before_s: float = 10.0
    flood_s: float = 30.0
    after_s: float = 15.0
    system_tokens: int = 1024
    question_tokens: int = 128
    output_tokens: int = 16
    users: int = 4  # end users (sessions) per tenant

    @property
    def duration_s(self) -> float:
        return self.before_s + self.flood_s + self.after_s

    def phase(self, t: float) -> str:
        if t < self.before_s:
            return "before"
        return "during" if t < self.before_s + self.flood_s else "after"


def quiet_names(p: NoisyParams) -> list[str]:
    return [f"quiet{i}" for i in range(p.quiet_tenants)]


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(*TOKEN_RANGE, n)]


def _arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    out, t = [], start
    if rate <= 0:
        return out
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= end:
            return out
        out.append(t)


def noisy_workload(p: NoisyParams, model: str = DEFAULT_MODEL) -> Workload:
    sessions: list[Session] = []
    tenants = [*quiet_names(p), FLOODER]
    for ti, tenant in enumerate(tenants):
        flooder = tenant == FLOODER
        rng = np.random.default_rng([p.seed, 0xF10, ti])
        system = _ids(rng, p.system_tokens)
        if flooder:
            times = _arrivals(
                rng, p.quiet_rate * p.flood_factor, p.before_s, p.before_s + p.flood_s
            )
        else:
            times = _arrivals(rng, p.quiet_rate, 0.0, p.duration_s)
        for k, t in enumerate(times):
            rid = f"{tenant}-{k}"
            ids = system + _ids(rng, p.question_tokens)
            user = f"{tenant}-u{k % max(1, p.users)}"
            script = one_shot(
                rid,
                tenant,
                ids,
                p.output_tokens,
                model,
                user=user,
                meta={"tenant": tenant},
                headers={TENANT_HEADER: tenant},
            )
            sessions.append(Session(rid, tenant, t, script))
    sessions.sort(key=lambda s: s.start_s)
    return Workload(
        "noisy_neighbour",
        f"{p.quiet_tenants} quiet tenants at {p.quiet_rate:g} req/s each for {p.duration_s:g} s; "
        f"tenant {FLOODER!r} floods open-loop at {p.flood_factor:g}x that rate from "
        f"{p.before_s:g} s for {p.flood_s:g} s; one-shot token-id prompts of a "
        f"{p.system_tokens}-token tenant system prompt + a {p.question_tokens}-token question, "
        f"{p.output_tokens} output tokens",
        sessions,
        model,
        params=asdict(p),
    )
