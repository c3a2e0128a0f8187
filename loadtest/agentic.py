"""Agentic sessions: closed-loop conversations whose context grows with tool results, that fork
sub-agents from a shared warm prefix, and that come and go.

A session is described by a **record** (a plain dict, one JSON object per line in a recorded
sessions file) and replayed closed-loop: each turn waits for the previous answer, then its
think time, then sends the whole conversation so far. The synthetic workload (:func:`agentic`)
draws records from a seed; :func:`recorded` reads them from a file; :func:`from_mooncake`
infers them from a Mooncake trace. All three replay through :func:`sessions_from_records`.

The record format (``docs/load-testing.md`` has the same, with an example)::

    {"session": "s7", "start_s": 12.5, "tenant": "acme", "kind": "coder",
     "system": "<text>" | "system_words": 3000, "tools": 12,
     "turns": [
        {"user": "<text>" | "user_words": 80, "think_s": 2.0, "max_tokens": 200,
         "tool_result": "<text>" | "tool_result_words": 1500,
         "subagent": {"kind": "explorer", "turns": [<turns, without subagent>]}},
        ...]}

- ``system`` / ``system_words``: the agent's system prompt (text, or that many words of
  deterministic filler seeded by the session's ``kind``, so every session of a kind shares it:
  the warm prefix); ``tools``: that many tool definitions, also drawn from the kind.
- a turn sends ``user`` (the task, first turn) or, on later turns, the previous answer comes
  back as an assistant message calling a tool and ``tool_result`` as the tool's answer; a turn
  with a ``user`` text after the first is a new instruction from the person.
- ``subagent``: before this turn's request the agent runs a sub-agent: a conversation of its
  own that starts from the same system prompt and tools (a new task), whose final answer is
  this turn's tool result. The parent waits for it (closed loop).
- ``think_s``: seconds between the previous answer and this request (time-scaled on replay).
- ``api`` (on the session, optional): ``chat`` (OpenAI's chat completions, the default) or
  ``messages`` (Anthropic's Messages API, sent through the ``anthropic`` SDK as Claude Code
  sends it: loadtest/anthropic_body.py); the same history either way.
- ``context_cap_tokens`` (on the session, optional): once the estimated context passes it, the
  agent compacts: the history is replaced by one summary message (a prefix break after the
  system prompt, as real agents' compaction is).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from loadtest import filler
from loadtest.anthropic_body import messages_body
from loadtest.spec import DEFAULT_MODEL, RequestSpec, Script, Session, Workload

TOKENS_PER_WORD = 1.25  # the filler's words are 1.1-1.3 Qwen3 tokens each
MOONCAKE_BLOCK_TOKENS = 512
AGENT_KINDS = ("coder", "reviewer", "researcher", "planner")
SUBAGENT_KIND = "explorer"


def _rng(*parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in parts))


def _words(rng: random.Random, n: int) -> str:
    return filler.paragraphs(rng, max(1, n))


def _tools(kind: str, n: int) -> list[dict[str, Any]]:
    return filler.tools(_rng("agentic", "tools", kind), n)


def _system(record: dict[str, Any]) -> str:
    if isinstance(record.get("system"), str):
        return record["system"]
    kind = str(record.get("kind", "agent"))
    n = int(record.get("system_words", 2000))
    return f"You are the {kind} agent. Follow the rules below.\n\n" + _words(
        _rng("agentic", "system", kind, n), n
    )


def _text(turn: dict[str, Any], field: str, *seed: object) -> str | None:
    if isinstance(turn.get(field), str):
        return str(turn[field])
    n = turn.get(f"{field}_words")
    if not n:
        return None
    return _words(_rng("agentic", field, *seed), int(n))


def estimate_tokens(messages: Iterable[dict[str, Any]]) -> int:
    """A quick estimate of a conversation's tokens (the compaction trigger)."""
    words = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            words += len(content.split())
        for call in m.get("tool_calls") or ():
            words += len(call["function"]["arguments"].split())
    return math.ceil(words * TOKENS_PER_WORD)


def _tool_call(session: str, turn: int) -> dict[str, Any]:
    args = json.dumps({"path": f"src/module_{turn}.py", "query": f"step {turn} of {session}"})
    return {
        "id": f"call_{session}_{turn}",
        "type": "function",
        "function": {"name": "read_file", "arguments": args},
    }


class _Conversation:
    """One agent's message history as a session replays it."""

    def __init__(self, session: str, system: str, cap: int | None) -> None:
        self.session = session
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.cap = cap
        self.compactions = 0

    def answered(self, answer: str, turn: int, tool_result: str | None) -> None:
        """The server's answer comes back; a tool result follows it as the tool's answer."""
        if tool_result is None:
            self.messages.append({"role": "assistant", "content": answer})
            return
        call = _tool_call(self.session, turn)
        self.messages.append({"role": "assistant", "content": answer, "tool_calls": [call]})
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result})

    def next_turn(
        self, turn: dict[str, Any], t: int, answer: str | None, result: str | None
    ) -> None:
        """The conversation as turn ``t`` sends it: the previous ``answer`` back (calling a
        tool whose ``result`` follows), the turn's own instruction if it has one (a first turn
        without one gets a plain start), then compacted past the cap."""
        if answer is not None:
            self.answered(answer, t, result)
        task = _text(turn, "user", self.session, t)
        if task is not None:
            self.messages.append({"role": "user", "content": task})
        elif len(self.messages) == 1:
            self.messages.append({"role": "user", "content": f"Start task {self.session}."})
        self.compact()

    def compact(self) -> None:
        if self.cap is None or estimate_tokens(self.messages) <= self.cap:
            return
        self.compactions += 1
        summary = _words(_rng("agentic", "summary", self.session, self.compactions), 300)
        self.messages = [
            self.messages[0],
            {"role": "user", "content": f"Summary of the work so far:\n\n{summary}"},
        ]


def _script(
    record: dict[str, Any], model: str, time_scale: float, tools: bool
) -> Callable[[], Script]:
    session = str(record["session"])
    kind = str(record.get("kind", "agent"))
    group = str(record.get("group") or kind)
    tenant = record.get("tenant")
    headers = {"X-Tenant": str(tenant)} if tenant else {}
    cap = record.get("context_cap_tokens")
    system = _system(record)
    tool_defs = _tools(kind, int(record.get("tools", 0))) if tools else []
    api = record.get("api", "chat")

    def body(messages: list[dict[str, Any]], max_tokens: int, defs: list[dict[str, Any]]) -> dict:
        if api == "messages":
            return messages_body(model, messages, max_tokens, defs)
        out: dict[str, Any] = {
            "model": model,
            "messages": [dict(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if defs:
            out["tools"] = defs
        return out

    def request(conv: _Conversation, turn: dict[str, Any], seq: int, meta: dict) -> RequestSpec:
        return RequestSpec(
            "messages" if api == "messages" else "chat",
            group=group,
            session=conv.session,
            turn=seq,
            body=body(conv.messages, int(turn.get("max_tokens", 128)), tool_defs),
            delay_s=float(turn.get("think_s", 0.0)) / time_scale,
            meta=meta,
            headers=headers,
        )

    def script() -> Script:
        conv = _Conversation(session, system, cap)
        seq = 0  # request index in this session (sub-agent requests included)
        last_answer: str | None = None
        for t, turn in enumerate(record["turns"]):
            tool_result = _text(turn, "tool_result", session, t)
            sub = turn.get("subagent")
            if sub:  # the sub-agent runs first; its final answer is this turn's tool result
                meta = {"agent": str(sub.get("kind", SUBAGENT_KIND)), "parent": session}
                sub_conv = _Conversation(f"{session}/sub{t}", system, cap)
                sub_answer: str | None = None
                for st, sturn in enumerate(sub["turns"]):
                    result = _text(sturn, "tool_result", sub_conv.session, st)
                    sub_conv.next_turn(sturn, st, sub_answer, result)
                    sub_answer = yield request(sub_conv, sturn, seq, {**meta, "subagent": True})
                    seq += 1
                    if sub_answer is None:
                        return
                tool_result = sub_answer
            conv.next_turn(turn, t, last_answer, tool_result)
            meta = {"agent": kind, "context_turn": t, "subagent": False}
            last_answer = yield request(conv, turn, seq, meta)
            seq += 1
            if last_answer is None:
                return

    return script


def request_count(record: dict[str, Any]) -> int:
    return sum(1 + len((t.get("subagent") or {}).get("turns", ())) for t in record["turns"])


def sessions_from_records(
    name: str,
    description: str,
    records: list[dict[str, Any]],
    *,
    model: str = DEFAULT_MODEL,
    time_scale: float = 1.0,
    tools: bool = True,
    params: dict[str, Any] | None = None,
) -> Workload:
    """Replay ``records`` closed-loop: each session's turns wait for the previous answer;
    ``time_scale`` divides start times and think times (10 = ten times faster)."""
    if not time_scale > 0:
        raise ValueError("time_scale must be positive")
    sessions = [
        Session(
            str(r["session"]),
            str(r.get("group") or r.get("kind", "agent")),
            float(r.get("start_s", 0.0)) / time_scale,
            _script(r, model, time_scale, tools),
            request_count(r),
        )
        for r in sorted(records, key=lambda r: float(r.get("start_s", 0.0)))
    ]
    return Workload(name, description, sessions, model, params=dict(params or {}))


# ---------------------------------------------------------------------------------------------
# the synthetic workload


def agentic_records(
    *,
    seed: int = 0,
    sessions: int = 24,
    rate: float = 0.5,
    tenants: int = 3,
    kinds: int = 3,
    turns: tuple[int, int] = (4, 12),
    think_time_s: float = 2.0,
    system_words: int = 2400,
    tools: int = 12,
    task_words: tuple[int, int] = (20, 120),
    tool_result_words: tuple[int, int] = (100, 3000),
    max_tokens: tuple[int, int] = (64, 400),
    subagent_share: float = 0.15,
    subagent_turns: tuple[int, int] = (2, 5),
    context_cap_tokens: int = 100_000,
    tenant_skew: float = 1.0,
    messages_share: float = 0.25,
) -> list[dict[str, Any]]:
    """Sessions of coding-agent shape, deterministic from ``seed``: Poisson arrivals at
    ``rate``/s; each picks a tenant (Zipf ``tenant_skew``) and an agent kind (one system prompt
    and tool set per kind: the warm prefix its sessions share); ``turns`` turns, each a tool
    call whose result (log-uniform ``tool_result_words``) comes back, an occasional new
    instruction from the person, exponential think times; a turn forks a sub-agent with
    probability ``subagent_share``. A share ``messages_share`` of the sessions speak Anthropic's
    Messages API (through its SDK), the others OpenAI's chat completions."""
    if not 0.0 <= messages_share <= 1.0:
        raise ValueError("messages_share is a share: from 0 to 1")
    if sessions < 0 or tenants < 1 or not 1 <= kinds <= len(AGENT_KINDS):
        raise ValueError(f"sessions >= 0, tenants >= 1, 1 <= kinds <= {len(AGENT_KINDS)}")
    arrivals = _rng("agentic", seed, "arrivals")
    weights = [1.0 / (t + 1) ** tenant_skew for t in range(tenants)]

    def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(max(1, lo)), math.log(max(1, hi))))))

    def turn(rng: random.Random, first: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "think_s": 0.0
            if first
            else round(rng.expovariate(1 / think_time_s), 3)
            if think_time_s > 0
            else 0.0,
            "max_tokens": rng.randint(*max_tokens),
            "tool_result_words": 0 if first else log_uniform(rng, *tool_result_words),
        }
        if first or rng.random() < 0.1:
            out["user_words"] = rng.randint(*task_words)
        return out

    records = []
    t_now = 0.0
    for i in range(sessions):
        rng = _rng("agentic", seed, "session", i)
        tenant = arrivals.choices(range(tenants), weights)[0]
        kind = AGENT_KINDS[arrivals.randrange(kinds)]
        turn_list = [turn(rng, j == 0) for j in range(rng.randint(*turns))]
        for j, tr in enumerate(turn_list):
            if j and rng.random() < subagent_share:
                n = rng.randint(*subagent_turns)
                tr["subagent"] = {
                    "kind": SUBAGENT_KIND,
                    "turns": [turn(rng, k == 0) for k in range(n)],
                }
        # Its own draw: the sessions' shapes do not depend on the share.
        api = "messages" if _rng("agentic", seed, "api", i).random() < messages_share else "chat"
        records.append(
            {
                "session": f"s{i}",
                "api": api,
                "start_s": round(t_now, 3),
                "tenant": f"tenant{tenant}",
                "kind": kind,
                "system_words": system_words,
                "tools": tools,
                "context_cap_tokens": context_cap_tokens,
                "turns": turn_list,
            }
        )
        if rate > 0 and math.isfinite(rate):
            t_now += arrivals.expovariate(rate)
    return records


def agentic(*, model: str = DEFAULT_MODEL, time_scale: float = 1.0, **kwargs: Any) -> Workload:
    records = agentic_records(**kwargs)
    n = len(records)
    return sessions_from_records(
        "agentic",
        f"{n} closed-loop agent sessions (tool results, sub-agents, a warm system prompt and "
        "tools per agent kind, contexts compacted past the cap)",
        records,
        model=model,
        time_scale=time_scale,
        params={**kwargs, "time_scale": time_scale},
    )


# ---------------------------------------------------------------------------------------------
# recorded sessions


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a JSON-lines file (blank lines and ``#`` comments skipped); a malformed
    line is a ValueError naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        check_record(record, f"{path}:{n}")
        out.append(record)
    return out


def check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict) or "session" not in record:
        raise ValueError(f"{where}: a record is an object with a 'session'")
    if record.get("api", "chat") not in ("chat", "messages"):
        raise ValueError(f"{where}: 'api' is 'chat' or 'messages'")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'turns' must be a non-empty list")
    for t in turns:
        if not isinstance(t, dict):
            raise ValueError(f"{where}: each turn is an object")
        sub = t.get("subagent")
        if sub is not None and not (isinstance(sub, dict) and isinstance(sub.get("turns"), list)):
            raise ValueError(f"{where}: a subagent is an object with a list of 'turns'")


def recorded(path: str | Path, *, model: str = DEFAULT_MODEL, time_scale: float = 1.0) -> Workload:
    records = read_records(path)
    return sessions_from_records(
        "sessions",
        f"{len(records)} recorded sessions from {Path(path).name}, replayed closed-loop",
        records,
        model=model,
        time_scale=time_scale,
        params={"path": str(path), "time_scale": time_scale},
    )


# ---------------------------------------------------------------------------------------------
# Mooncake -> sessions


def block_text(hash_id: int) -> str:
    """The text that stands for one Mooncake block (512 tokens of some prompt): about 410
    words of filler seeded by the hash id, so equal ids give equal text and a request that
    extends another's ids extends its text."""
    return _words(_rng("mooncake", hash_id), int(MOONCAKE_BLOCK_TOKENS / TOKENS_PER_WORD))


def link_sessions(rows: list[dict[str, Any]], hot: int = 8) -> tuple[list[list[int]], float]:
    """Group trace rows into sessions: a row whose ``hash_ids`` start with all of an earlier
    row's full blocks (its ids but the last, a partial block unless the prompt fills it) is
    that row's next turn, the longest such earlier row that no other row has continued yet.
    A match only on a prefix more than ``hot`` earlier rows start with is a shared system
    prompt, not a conversation, and links nothing. Returns the sessions (row indices in
    arrival order) and the share of rows linked to an earlier one."""
    starts: Counter[tuple[int, ...]] = Counter()  # prefix -> earlier rows starting with it
    latest: dict[tuple[int, ...], int] = {}  # an open session's last full blocks -> session
    sessions: list[list[int]] = []
    linked = 0
    for i, row in enumerate(rows):
        ids = tuple(row.get("hash_ids") or ())
        owner = None
        for k in range(len(ids), 0, -1):  # the longest earlier prefix first
            if ids[:k] in latest and starts[ids[:k]] <= hot:
                owner = latest.pop(ids[:k])
                break
        if owner is None:
            sessions.append([i])
            owner = len(sessions) - 1
        else:
            sessions[owner].append(i)
            linked += 1
        full = ids[:-1] if int(row.get("input_length", 0)) % MOONCAKE_BLOCK_TOKENS else ids
        if full:
            latest[full] = owner
        for k in range(1, len(ids) + 1):
            starts[ids[:k]] += 1
    return sessions, (linked / len(rows) if rows else 0.0)


def from_mooncake(
    rows: list[dict[str, Any]], *, max_tokens_cap: int = 256
) -> tuple[list[dict[str, Any]], float]:
    """Session records inferred from Mooncake rows (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``): each session's first row sends the text of all its
    blocks as the task; a later row sends the text of the blocks it adds as a new user message
    (the earlier answer stays in the history as the server gave it), after a think time equal
    to the gap between the two arrivals. Returns the records and the share of rows linked."""
    sessions, share = link_sessions(rows)
    records = []
    for n, members in enumerate(sessions):
        turns = []
        seen = 0
        prev_ts = None
        for i in members:
            row = rows[i]
            ids = list(row.get("hash_ids") or ())
            ts = float(row.get("timestamp", 0)) / 1000
            new = ids[seen:] or ids[-1:]
            turns.append(
                {
                    "user": "\n\n".join(block_text(h) for h in new),
                    "think_s": 0.0 if prev_ts is None else max(0.0, round(ts - prev_ts, 3)),
                    "max_tokens": max(1, min(int(row.get("output_length", 1)), max_tokens_cap)),
                }
            )
            seen, prev_ts = len(ids), ts
        first = rows[members[0]]
        records.append(
            {
                "session": f"m{n}",
                "start_s": float(first.get("timestamp", 0)) / 1000,
                "kind": "mooncake",
                "group": f"h{(first.get('hash_ids') or [0])[0]}",
                "system": "You are a helpful assistant.",
                "turns": turns,
            }
        )
    return records, share


def read_mooncake(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def write_records(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    n = 0
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
            n += 1
    return n


def iter_specs(workload: Workload, answer: Callable[[RequestSpec], str]) -> Iterator[RequestSpec]:
    """Every request of every session, run offline with ``answer`` (tests)."""
    for s in workload.sessions:
        gen = s.script()
        try:
            spec = next(gen)
            while True:
                yield spec
                spec = gen.send(answer(spec))
        except StopIteration:
            pass


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.agentic --from-mooncake TRACE --out FILE``: recorded sessions
    inferred from a Mooncake trace (prints how many rows were linked into sessions)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m loadtest.agentic", description=main.__doc__)
    p.add_argument("--from-mooncake", required=True, metavar="TRACE", help="Mooncake JSON lines")
    p.add_argument("--out", required=True, help="the recorded-sessions file to write")
    p.add_argument("--limit", type=int, default=None, help="read at most this many rows")
    p.add_argument("--max-tokens", type=int, default=256, help="cap on each turn's max_tokens")
    args = p.parse_args(argv)
    rows = read_mooncake(args.from_mooncake, args.limit)
    records, share = from_mooncake(rows, max_tokens_cap=args.max_tokens)
    write_records(records, args.out)
    turns = sum(len(r["turns"]) for r in records)
    print(
        f"{len(rows)} rows -> {len(records)} sessions ({turns} turns); {share:.1%} of rows "
        f"continue an earlier one; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
