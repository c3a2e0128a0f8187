"""Workload generators: request bodies, arrival times and a prefix-group label, from a seed.

A workload is a list of :class:`Session` objects sorted by arrival time. A session is a small
script (a generator) that yields one :class:`RequestSpec` per turn and is sent back the text
of the server's answer (``None`` when the request failed), so a conversation's next turn is
built from what the server really said. One-shot workloads (trace replay, prefix repetition)
are sessions of one turn.

Everything is deterministic from ``seed``: each session draws from its own RNG, seeded from
``(seed, workload, session index)``, so the bodies do not depend on the order in which
concurrent sessions happen to run. (A conversation's later turns contain the server's answers,
which are deterministic only as far as the server is.)

Workloads:

- :func:`preamble` -- the "preamble position" experiment from the seeds: a long shared system
  prompt and tool schema, an ~11-token per-request preamble (time / request id / user name)
  placed ``first`` (before the system prompt), ``after_system`` (right after the system prompt
  and tool schema, before the conversation) or ``last`` (just before the user's question),
  multi-turn conversations. Expected fleet hit rate: about zero / middle / high.
- :func:`multi_tenant` -- tenants with their own system prompts, Poisson conversation
  arrivals, multi-turn conversations that send the server's answers back, think time between
  turns, Zipf-skewed tenant popularity.
- :func:`trace` -- Mooncake (FAST'25) trace replay with token-id prompts on /v1/completions.
- :func:`pressure` -- issue 15's scenario (many tenants, one hot, long system prompts; see
  ``loadtest.pressure``), token-id prompts; ``python -m loadtest.bench_pressure`` replays it in
  simulated time.
- :func:`noisy_neighbour` -- issue 32's scenario (quiet tenants, one flooding open-loop; see
  ``loadtest.noisy``); ``python -m loadtest.bench_flow`` runs it with flow control off and on.
- :func:`loadtest.agentic.agentic` -- closed-loop agent sessions: tool results growing the
  context to a cap, sub-agents forked from a shared warm prefix per agent kind, sessions
  arriving and leaving; ``sessions`` replays recorded ones from a JSON-lines file.
- :func:`prefix_repetition` -- N prefixes x M suffixes, like ``vllm bench serve --dataset-name
  prefix_repetition``. Flatters hit rates (see the warning it carries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import agentic, filler
from loadtest.noisy import NoisyParams, noisy_workload
from loadtest.pressure import PressureParams, pressure_workload
from loadtest.spec import (
    DEFAULT_MODEL,
    Endpoint,
    RequestSpec,
    Script,
    Session,
    Workload,
    one_shot,
)
from loadtest.trace import trace_workload

__all__ = [
    "DEFAULT_MODEL",
    "PREAMBLE_POSITIONS",
    "WORKLOADS",
    "Endpoint",
    "RequestSpec",
    "Script",
    "Session",
    "Workload",
    "build",
    "collect_specs",
    "make_preamble",
    "multi_tenant",
    "noisy_neighbour",
    "preamble",
    "prefix_repetition",
    "pressure",
    "tenant_system_prompt",
    "trace",
]

PREAMBLE_POSITIONS = ("first", "after_system", "last")
WORKLOADS = (
    "preamble",
    "multi_tenant",
    "trace",
    "prefix_repetition",
    "pressure",
    "noisy_neighbour",
    "agentic",
    "sessions",
)


# ---------------------------------------------------------------------------------------------
# preamble


def make_preamble(request_index: int, user: str, seed: int) -> str:
    """The volatile per-request header: a time, a request id and the user's name, about 11
    Qwen3 tokens (``[14:31 req 1a7 Alice]``). Unique per request within a run."""
    t = 8 * 3600 + 7 * request_index + (seed % 3600)
    hh, mm = divmod(t // 60, 60)
    return f"[{hh % 24:02d}:{mm:02d} req {request_index:x} {user}]"


def preamble(
    position: str = "last",
    *,
    seed: int = 0,
    conversations: int = 8,
    turns: int = 15,
    system_words: int = 900,
    tools: int = 6,
    user_words: tuple[int, int] = (12, 40),
    max_tokens: int = 32,
    think_time_s: float = 0.0,
    stagger_s: float = 0.02,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """The seeds' preamble-position experiment.

    All requests share one long system prompt and a tool schema (``system_words`` words and
    ``tools`` tools: about 2,050 Qwen3 tokens at the defaults). Each request carries an
    ~11-token preamble unique to it.
    ``position`` puts it:

    - ``first``: at the top of the system message, before the system prompt -> block 0 differs
      for every request; hit rate about zero.
    - ``after_system``: as a second system message right after the system prompt and tools,
      before the conversation -> the shared system prompt hits, every turn's history misses.
    - ``last``: at the start of the current user message, just before the question. It stays in
      that message in the conversation history (as a chat app that stores what it sent would),
      so the whole earlier conversation, the server's own answers included, stays a prefix.

    ``conversations`` conversations of ``turns`` turns each all start at once (staggered by
    ``stagger_s``); each turn sends the previous answers back. Prefix group = conversation.
    """
    if position not in PREAMBLE_POSITIONS:
        raise ValueError(f"position must be one of {PREAMBLE_POSITIONS}, not {position!r}")
    base = filler.rng(seed, "preamble", "shared")
    system = (
        "You are the support assistant of Acme Cloud. Follow the policies below.\n\n"
        + filler.paragraphs(base, system_words)
    )
    tool_schema = filler.tools(base, tools)

    def conversation(ci: int) -> Callable[[], Script]:
        def script() -> Script:
            rng = filler.rng(seed, "preamble", "conv", ci)
            user = filler.NAMES[ci % len(filler.NAMES)]
            history: list[dict[str, Any]] = []
            for turn in range(turns):
                question = filler.question(rng, rng.randint(*user_words))
                idx = ci * turns + turn
                pre = make_preamble(idx, user, seed)
                if position == "first":
                    msgs = [
                        {"role": "system", "content": pre + "\n" + system},
                        *history,
                        {"role": "user", "content": question},
                    ]
                    history.append({"role": "user", "content": question})
                elif position == "after_system":
                    msgs = [
                        {"role": "system", "content": system},
                        {"role": "system", "content": pre},
                        *history,
                        {"role": "user", "content": question},
                    ]
                    history.append({"role": "user", "content": question})
                else:
                    user_msg = {"role": "user", "content": pre + "\n" + question}
                    msgs = [{"role": "system", "content": system}, *history, user_msg]
                    history.append(user_msg)
                body = {
                    "model": model,
                    "messages": msgs,
                    "tools": tool_schema,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                answer = yield RequestSpec(
                    "chat",
                    group=f"conv{ci}",
                    session=f"conv{ci}",
                    turn=turn,
                    body=body,
                    delay_s=think_time_s if turn else 0.0,
                    meta={"preamble": pre},
                )
                if answer is None:
                    return
                history.append({"role": "assistant", "content": answer})

        return script

    sessions = [
        Session(f"conv{ci}", f"conv{ci}", ci * stagger_s, conversation(ci), turns)
        for ci in range(conversations)
    ]
    return Workload(
        "preamble",
        f"Preamble position experiment: ~11-token per-request preamble placed {position!r}; "
        f"{conversations} conversations x {turns} turns sharing a ~{system_words}-word system "
        f"prompt and {tools} tools.",
        sessions,
        model,
        params=dict(
            position=position,
            seed=seed,
            conversations=conversations,
            turns=turns,
            system_words=system_words,
            tools=tools,
            user_words=list(user_words),
            max_tokens=max_tokens,
            think_time_s=think_time_s,
        ),
    )


# ---------------------------------------------------------------------------------------------
# multi_tenant


def tenant_system_prompt(seed: int, tenant: int, system_words: int) -> str:
    rng = filler.rng(seed, "multi_tenant", "tenant", tenant)
    company = filler.COMPANIES[tenant % len(filler.COMPANIES)]
    return f"{company} tenant {tenant}: you are {company}'s assistant.\n\n" + filler.paragraphs(
        rng, system_words
    )


def multi_tenant(
    *,
    seed: int = 0,
    tenants: int = 4,
    conversations: int = 40,
    rate: float = 2.0,
    turns: tuple[int, int] = (2, 6),
    think_time_s: float = 1.0,
    system_words: int = 800,
    user_words: tuple[int, int] = (10, 60),
    max_tokens: int = 48,
    tenant_skew: float = 1.0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Tenants with their own system prompts (distinct from token 0); ``conversations``
    conversations arrive as a Poisson process of ``rate`` per second, each picks a tenant
    (Zipf weights with exponent ``tenant_skew``; 0 = uniform) and runs ``turns`` (inclusive
    range) turns, each turn sending the history with the server's actual answers back after an
    exponential think time of mean ``think_time_s``. Prefix group = tenant."""
    if tenants < 1 or conversations < 0:
        raise ValueError("tenants must be >= 1 and conversations >= 0")
    prompts = [tenant_system_prompt(seed, t, system_words) for t in range(tenants)]
    weights = [1.0 / (t + 1) ** tenant_skew for t in range(tenants)]
    arrivals = filler.rng(seed, "multi_tenant", "arrivals")
    t_now = 0.0
    sessions = []
    for ci in range(conversations):
        tenant = arrivals.choices(range(tenants), weights)[0]
        n_turns = arrivals.randint(*turns)
        sessions.append(
            Session(
                f"t{tenant}-c{ci}",
                f"tenant{tenant}",
                t_now,
                _tenant_conversation(
                    seed,
                    ci,
                    tenant,
                    prompts[tenant],
                    n_turns,
                    think_time_s,
                    user_words,
                    max_tokens,
                    model,
                ),
                n_turns,
            )
        )
        if rate > 0 and math.isfinite(rate):
            t_now += arrivals.expovariate(rate)
    return Workload(
        "multi_tenant",
        f"{tenants} tenants with distinct ~{system_words}-word system prompts; {conversations} "
        f"multi-turn conversations ({turns[0]}-{turns[1]} turns) arriving Poisson at "
        f"{rate}/s, think time ~Exp({think_time_s} s), answers sent back.",
        sessions,
        model,
        params=dict(
            seed=seed,
            tenants=tenants,
            conversations=conversations,
            rate=rate,
            turns=list(turns),
            think_time_s=think_time_s,
            system_words=system_words,
            user_words=list(user_words),
            max_tokens=max_tokens,
            tenant_skew=tenant_skew,
        ),
    )


def _tenant_conversation(
    seed: int,
    ci: int,
    tenant: int,
    system: str,
    n_turns: int,
    think_time_s: float,
    user_words: tuple[int, int],
    max_tokens: int,
    model: str,
) -> Callable[[], Script]:
    def script() -> Script:
        rng = filler.rng(seed, "multi_tenant", "conv", ci)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in range(n_turns):
            msgs.append({"role": "user", "content": filler.question(rng, rng.randint(*user_words))})
            think = rng.expovariate(1.0 / think_time_s) if think_time_s > 0 and turn else 0.0
            body = {
                "model": model,
                "messages": list(msgs),
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            answer = yield RequestSpec(
                "chat",
                group=f"tenant{tenant}",
                session=f"t{tenant}-c{ci}",
                turn=turn,
                body=body,
                delay_s=think,
            )
            if answer is None:
                return
            msgs.append({"role": "assistant", "content": answer})

    return script


# ---------------------------------------------------------------------------------------------
# trace (implemented in loadtest.trace)


def trace(path: str | Path | None = None, **kwargs: Any) -> Workload:
    """Mooncake-format trace replay; see :func:`loadtest.trace.trace_workload`."""
    return trace_workload(path, **kwargs)


# ---------------------------------------------------------------------------------------------
# prefix_repetition

PREFIX_REPETITION_WARNING = (
    "prefix_repetition flatters hit rates: a handful of prefixes replayed back to back is the "
    "best case for any cache and any router, far above what production traffic reaches; do not "
    "use it as a baseline for alerts or for claims about real workloads."
)


def prefix_repetition(
    *,
    seed: int = 0,
    num_prefixes: int = 10,
    suffixes_per_prefix: int = 8,
    prefix_len: int = 256,
    suffix_len: int = 256,
    output_len: int = 32,
    rate: float = math.inf,
    token_range: tuple[int, int] = (1000, 100_000),
    model: str = DEFAULT_MODEL,
) -> Workload:
    """``num_prefixes`` random token prefixes of ``prefix_len`` tokens, each followed by
    ``suffixes_per_prefix`` random suffixes of ``suffix_len`` tokens (like ``vllm bench serve
    --dataset-name prefix_repetition``, but as exact token ids on /v1/completions), shuffled,
    arriving Poisson at ``rate`` per second (inf = all at once; the concurrency cap paces
    them). Prefix group = prefix index."""
    rng = np.random.default_rng([seed, 0x5EED])
    lo, hi = token_range
    prefixes = [rng.integers(lo, hi, prefix_len).tolist() for _ in range(num_prefixes)]
    pairs = [(p, s) for p in range(num_prefixes) for s in range(suffixes_per_prefix)]
    order = filler.rng(seed, "prefix_repetition", "order")
    order.shuffle(pairs)
    t_now = 0.0
    sessions = []
    for p, s in pairs:
        suffix = np.random.default_rng([seed, p, s]).integers(lo, hi, suffix_len).tolist()
        sessions.append(
            Session(
                f"p{p}s{s}",
                f"prefix{p}",
                t_now,
                one_shot(f"p{p}s{s}", f"prefix{p}", prefixes[p] + suffix, output_len, model),
            )
        )
        if math.isfinite(rate) and rate > 0:
            t_now += order.expovariate(rate)
    return Workload(
        "prefix_repetition",
        f"{num_prefixes} prefixes x {suffixes_per_prefix} suffixes ({prefix_len} + {suffix_len} "
        f"tokens), output {output_len} tokens, like vllm bench's prefix_repetition dataset.",
        sessions,
        model,
        params=dict(
            seed=seed,
            num_prefixes=num_prefixes,
            suffixes_per_prefix=suffixes_per_prefix,
            prefix_len=prefix_len,
            suffix_len=suffix_len,
            output_len=output_len,
            rate=rate,
        ),
        warnings=[PREFIX_REPETITION_WARNING],
    )


# ---------------------------------------------------------------------------------------------
# pressure (implemented in loadtest.pressure)


def pressure(*, model: str = DEFAULT_MODEL, **kwargs: Any) -> Workload:
    """Issue 15's scenario; ``kwargs`` are :class:`loadtest.pressure.PressureParams` fields."""
    return pressure_workload(PressureParams(**kwargs), model)


# ---------------------------------------------------------------------------------------------
# noisy_neighbour (implemented in loadtest.noisy)


def noisy_neighbour(*, model: str = DEFAULT_MODEL, **kwargs: Any) -> Workload:
    """Issue 32's scenario; ``kwargs`` are :class:`loadtest.noisy.NoisyParams` fields."""
    return noisy_workload(NoisyParams(**kwargs), model)


# ---------------------------------------------------------------------------------------------


def sessions(
    *, path: str | Path | None = None, seed: int = 0, model: str = DEFAULT_MODEL, **kwargs: Any
) -> Workload:
    """Recorded agent sessions (``loadtest.agentic``'s JSON-lines format), replayed closed-loop."""
    if path is None:
        raise ValueError("the sessions workload needs a file of recorded sessions (--sessions)")
    return agentic.recorded(path, model=model, **kwargs)


def build(name: str, **kwargs: Any) -> Workload:
    """Build a workload by name (``preamble``, ``multi_tenant``, ``trace``,
    ``prefix_repetition``, ``pressure``); ``kwargs`` go to its constructor."""
    makers: dict[str, Callable[..., Workload]] = {
        "preamble": preamble,
        "multi_tenant": multi_tenant,
        "trace": trace,
        "prefix_repetition": prefix_repetition,
        "pressure": pressure,
        "noisy_neighbour": noisy_neighbour,
        "agentic": agentic.agentic,
        "sessions": sessions,
    }
    if name not in makers:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return makers[name](**kwargs)


def collect_specs(
    workload: Workload, answer: Callable[[RequestSpec], str | None] | None = None
) -> list[RequestSpec]:
    """Run every session's script offline (answers from ``answer``, default a fixed string),
    in session order. For tests and for inspecting a workload without a server."""
    out = []
    for s in workload.sessions:
        gen = s.script()
        try:
            spec = next(gen)
            while True:
                out.append(spec)
                spec = gen.send(answer(spec) if answer else f"Answer to turn {spec.turn}.")
        except StopIteration:
            pass
    return out
