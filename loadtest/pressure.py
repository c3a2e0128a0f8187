"""The ``pressure`` workload: routing matters for both the hit rate and the TTFT tail.

Shaped like issue 15's scenario: 32 tenants with ~2,500-token system prompts, Zipf 1.25 tenant
popularity (the hottest sends about a third of the traffic), 4-turn conversations arriving
Poisson at 4/s. Prompts are token ids (no tokenizer), and each turn's answer is a fixed
token sequence drawn from the seed, so a conversation's later prompts are known up front: the
simulated replicas "generate" exactly those answers (``Turn.output``), and the HTTP form
(:func:`pressure_workload`) sends them back as the history whatever the server answered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.spec import DEFAULT_MODEL, RequestSpec, Script, Session, Workload

TOKEN_RANGE = (1000, 100_000)


@dataclass(frozen=True)
class Turn:
    prompt: tuple[int, ...]  # the whole history: system + earlier turns + this question
    output: tuple[int, ...]  # the answer the simulated replica generates
    think_s: float  # wait after the previous turn's answer (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    id: str
    tenant: int
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class PressureParams:
    seed: int = 0
    tenants: int = 32
    conversations: int = 480
    rate: float = 4.0  # conversations per second
    turns: int = 4
    system_tokens: tuple[int, int] = (2300, 2700)
    user_tokens: tuple[int, int] = (20, 100)
    output_tokens: tuple[int, int] = (30, 120)
    think_time_s: float = 2.0  # mean, exponential
    tenant_skew: float = 1.25  # Zipf exponent


def tenant_weights(tenants: int, skew: float) -> list[float]:
    w = [1.0 / (t + 1) ** skew for t in range(tenants)]
    total = sum(w)
    return [x / total for x in w]


def _ids(rng: np.random.Generator, lo_hi: tuple[int, int]) -> tuple[int, ...]:
    n = int(rng.integers(lo_hi[0], lo_hi[1] + 1))
    return tuple(int(x) for x in rng.integers(*TOKEN_RANGE, n))


def conversations(p: PressureParams = PressureParams()) -> list[Conversation]:
    """The conversations in arrival order, deterministic from ``p.seed``: each tenant's system
    prompt from ``(seed, tenant)``, each conversation from ``(seed, index)``."""
    systems = [
        _ids(np.random.default_rng([p.seed, 1, t]), p.system_tokens) for t in range(p.tenants)
    ]
    weights = tenant_weights(p.tenants, p.tenant_skew)
    arrivals = np.random.default_rng([p.seed, 2])
    out = []
    t_now = 0.0
    for ci in range(p.conversations):
        tenant = int(arrivals.choice(p.tenants, p=weights))
        rng = np.random.default_rng([p.seed, 3, ci])
        history = systems[tenant]
        turns = []
        for k in range(p.turns):
            history = history + _ids(rng, p.user_tokens)
            output = _ids(rng, p.output_tokens)
            think = float(rng.exponential(p.think_time_s)) if k else 0.0
            turns.append(Turn(history, output, think))
            history = history + output
        out.append(Conversation(f"t{tenant}-c{ci}", tenant, t_now, tuple(turns)))
        t_now += float(arrivals.exponential(1.0 / p.rate))
    return out


def pressure_workload(p: PressureParams = PressureParams(), model: str = DEFAULT_MODEL) -> Workload:
    """The same conversations as a ``Workload`` for the HTTP runner (token-id prompts on
    /v1/completions, ``max_tokens`` = the planned answer's length)."""
    sessions = [
        Session(c.id, f"tenant{c.tenant}", c.start_s, _script(c, model), len(c.turns))
        for c in conversations(p)
    ]
    return Workload(
        "pressure",
        f"{p.tenants} tenants with ~{sum(p.system_tokens) // 2}-token system prompts, Zipf "
        f"{p.tenant_skew}; {p.conversations} {p.turns}-turn conversations at {p.rate}/s.",
        sessions,
        model,
        params=dict(seed=p.seed, tenants=p.tenants, conversations=p.conversations, rate=p.rate),
    )


def _script(c: Conversation, model: str) -> Callable[[], Script]:
    def script() -> Script:
        for k, turn in enumerate(c.turns):
            ids: Sequence[int] = list(turn.prompt)
            answer = yield RequestSpec(
                "completions",
                group=f"tenant{c.tenant}",
                session=c.id,
                turn=k,
                body={
                    "model": model,
                    "prompt": list(ids),
                    "max_tokens": len(turn.output),
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                token_ids_fn=lambda ids=ids: list(ids),  # type: ignore[misc]
                delay_s=turn.think_s,
            )
            if answer is None:
                return

    return script
