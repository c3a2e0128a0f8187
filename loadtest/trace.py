"""Mooncake trace replay: hash ids -> fixed token blocks -> token-id prompts on /v1/completions.

The Mooncake traces (Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST'25;
github.com/kvcache-ai/Mooncake, Apache-2.0) give per request ``{timestamp (ms), input_length,
output_length, hash_ids}``: one id per 512-token block, chained (two requests share an id at
position i exactly when their first i + 1 blocks are identical). Replaying one needs token ids
with the same sharing structure: each hash id becomes a fixed pseudo-random block of 512
ordinary Qwen3 token ids, drawn from an RNG seeded with (seed, hash id). Any file in the same
JSON-lines format can be replayed (``--trace FILE``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.spec import DEFAULT_MODEL, RequestSpec, Script, Session, Workload

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRACE = DATA_DIR / "mooncake_conversation_trace_head3000.jsonl"


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path | None = None, *, limit: int | None = None) -> list[TraceRow]:
    """Read a Mooncake-format JSON-lines trace: ``{timestamp (ms), input_length,
    output_length, hash_ids}`` per line, one chained hash id per 512-token block."""
    rows = []
    p = Path(path) if path is not None else DEFAULT_TRACE
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(
                    TraceRow(
                        float(d["timestamp"]),
                        int(d["input_length"]),
                        int(d["output_length"]),
                        tuple(int(h) for h in d["hash_ids"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{p}:{lineno}: not a trace row ({e})") from e
            if limit is not None and len(rows) >= limit:
                break
    return rows


def trace_block(
    hash_id: int,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    token_range: tuple[int, int] = (1000, 100_000),
) -> np.ndarray:
    """The fixed block of token ids that trace hash id ``hash_id`` stands for: drawn from an
    RNG seeded with ``(seed, hash_id)``, ids in ``token_range`` (ordinary Qwen3 tokens)."""
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(token_range[0], token_range[1], size=block_tokens, dtype=np.int64)


def trace_tokens(
    row: TraceRow,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    token_range: tuple[int, int] = (1000, 100_000),
) -> list[int]:
    """A trace row's prompt: its hash ids' blocks concatenated, cut to ``input_length``."""
    need = -(-row.input_length // block_tokens)
    if len(row.hash_ids) < need:
        raise ValueError(
            f"row has {len(row.hash_ids)} hash ids, input_length "
            f"{row.input_length} needs {need} blocks of {block_tokens}"
        )
    if need == 0:
        return []
    parts = [
        trace_block(h, seed=seed, block_tokens=block_tokens, token_range=token_range)
        for h in row.hash_ids[:need]
    ]
    return np.concatenate(parts)[: row.input_length].tolist()


def trace_workload(
    path: str | Path | None = None,
    *,
    seed: int = 0,
    time_scale: float = 1.0,
    max_output_tokens: int | None = 128,
    max_requests: int | None = None,
    max_input_tokens: int | None = 40_000,
    block_tokens: int = 512,
    token_range: tuple[int, int] = (1000, 100_000),
    ignore_eos: bool = True,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Replay a Mooncake-format trace (default: the bundled first 3,000 rows of the FAST'25
    conversation trace) as token-id prompts on /v1/completions.

    Each hash id becomes a fixed block of ``block_tokens`` token ids (:func:`trace_block`), so
    rows that share leading hash ids share exactly those prompt blocks; the last block is cut to
    ``input_length``. Arrival = ``timestamp / 1000 / time_scale`` seconds (``time_scale`` 10 =
    ten times faster). ``max_tokens`` = ``output_length``, capped at ``max_output_tokens``.
    Rows longer than ``max_input_tokens`` (default: under Qwen3-0.6B's 40,960-token context)
    are skipped and counted in the workload's warnings. Prefix group = the row's first
    conversation-specific hash id (``hash_ids[1]``; every row shares ``hash_ids[0]``)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    rows = load_trace(path)
    kept = [r for r in rows if max_input_tokens is None or r.input_length <= max_input_tokens]
    skipped = len(rows) - len(kept)
    if max_requests is not None:
        kept = kept[:max_requests]
    t0 = min((r.timestamp_ms for r in kept), default=0.0)
    sessions = []
    for i, row in enumerate(kept):
        group = (
            f"h{row.hash_ids[1] if len(row.hash_ids) > 1 else row.hash_ids[0]}"
            if row.hash_ids
            else "h-"
        )
        sessions.append(
            Session(
                f"r{i}",
                group,
                (row.timestamp_ms - t0) / 1000.0 / time_scale,
                _trace_script(
                    i,
                    group,
                    row,
                    seed,
                    max_output_tokens,
                    block_tokens,
                    token_range,
                    ignore_eos,
                    model,
                ),
            )
        )
    warnings = []
    if skipped:
        warnings.append(
            f"trace: skipped {skipped} of {len(rows)} rows longer than "
            f"{max_input_tokens} input tokens"
        )
    return Workload(
        "trace",
        f"Mooncake-format trace replay ({Path(path).name if path else DEFAULT_TRACE.name}): "
        f"{len(kept)} requests, time compressed {time_scale}x, token-id prompts "
        f"({block_tokens}-token blocks per hash id).",
        sessions,
        model,
        params=dict(
            path=str(path or DEFAULT_TRACE),
            seed=seed,
            time_scale=time_scale,
            max_output_tokens=max_output_tokens,
            max_requests=max_requests,
            max_input_tokens=max_input_tokens,
            block_tokens=block_tokens,
            token_range=list(token_range),
        ),
        warnings=warnings,
    )


def _trace_script(
    i: int,
    group: str,
    row: TraceRow,
    seed: int,
    cap: int | None,
    block_tokens: int,
    token_range: tuple[int, int],
    ignore_eos: bool,
    model: str,
) -> Callable[[], Script]:
    max_tokens = max(1, row.output_length if cap is None else min(cap, row.output_length))

    def ids() -> list[int]:
        return trace_tokens(row, seed=seed, block_tokens=block_tokens, token_range=token_range)

    def body() -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": model,
            "prompt": ids(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    def script() -> Script:
        yield RequestSpec(
            "completions",
            group=group,
            session=f"r{i}",
            turn=0,
            body_fn=body,
            token_ids_fn=ids,
            meta={"input_length": row.input_length, "output_length": row.output_length},
        )

    return script
