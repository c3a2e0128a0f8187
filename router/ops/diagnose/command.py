"""``prefix-router diagnose FILE``: the report for captured request bodies, tokenized by
the gateway's own ``RequestPath.prepare`` (no replica needed)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from router.config import ConfigError
from router.core.errors import APIError
from router.ops.command_line import HelpFormatter, OneLineParser
from router.ops.diagnose.analysis import Sample, tool_names
from router.ops.diagnose.render import render_text
from router.ops.diagnose.window import analyze
from router.ops.explain import endpoint_of
from router.ops.offline import open_offline


def _field(body: Mapping[str, Any], path: str) -> str | None:
    cur: Any = body
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    if cur is None:
        return None
    return (cur if isinstance(cur, str) else json.dumps(cur, sort_keys=True))[:64]


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(
        formatter_class=HelpFormatter,
        prog="prefix-router diagnose",
        description="Explain a low prefix-cache hit rate from captured request bodies (JSON "
        "lines of OpenAI chat/completions bodies, in arrival order): the ideal hit rate, the "
        "first-divergence histogram with the culprit lines, and reordering suggestions. "
        "Tokenized exactly as the live gateway does (RequestPath.prepare).",
    )
    p.add_argument("file", help="JSON-lines file of request bodies ('-': standard input)")
    p.add_argument(
        "--tokenizer",
        help="tokenizer directory or model id (default: the model the first body names, as "
        "serve finds it: a bundled tokenizer, else the local Hugging Face cache)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (vLLM --block-size)"
    )
    p.add_argument("--group-by", help="body field to group by, e.g. user or metadata.app")
    p.add_argument("--config", help="gateway config file (salt policy, tenants)")
    p.add_argument("--redact", action="store_true", help="positions and counts only, no text")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    opened = open_offline("diagnose", a)
    if opened is None:
        return 2
    gateway, stream = opened

    samples: list[Sample] = []
    skipped: list[str] = []

    async def run() -> None:
        for n, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                body = json.loads(line)
                endpoint = endpoint_of(body)
                rr = await gateway.path.prepare(
                    line.encode(), {}, endpoint, f"line-{n}-{uuid.uuid4().hex[:6]}"
                )
            except ValueError as e:
                skipped.append(f"line {n}: not JSON: {e}")
                continue
            except APIError as e:
                skipped.append(f"line {n}: {e.message}")
                continue
            samples.append(
                Sample(
                    token_ids=rr.token_ids,
                    block_size=rr.block_size,
                    model=rr.model,
                    tenant="all",
                    app=_field(body, a.group_by) if a.group_by else None,
                    block_hashes=rr.block_hashes,
                    cache_salt=rr.cache_salt,
                    lora=rr.lora,
                    max_tokens=rr.max_tokens,
                    tools=tool_names(body) if endpoint == "chat" else None,
                )
            )

    try:
        asyncio.run(run())
    except ConfigError as e:  # the file could not be read to its end
        print(f"prefix-router diagnose: {e}", file=sys.stderr)
        return 2
    gateway.executor.shutdown(wait=False)
    rep = analyze(
        samples,
        decode=None if a.redact else gateway.decoder,
        redact=a.redact,
    )
    rep["scope"]["source"] = a.file
    rep["scope"]["group_by"] = a.group_by
    rep["scope"]["skipped_lines"] = len(skipped)
    for s in skipped[:5]:
        print(f"prefix-router diagnose: skipped {s}", file=sys.stderr)
    if a.json:
        print(json.dumps(rep, indent=2, ensure_ascii=False))
    else:
        print(render_text(rep), end="")
    return 0 if samples else 1
