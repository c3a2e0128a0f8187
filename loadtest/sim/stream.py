"""Server-sent events for a streaming request: each token is written when it falls due in
virtual time (``Seq.tokens_due``), one SSE event per token, as vLLM streams them.

Chat chunks are vLLM 0.34's byte for byte in their fields and order (chat_completion/serving.py,
``chat_completion_stream_generator``, serialized with ``exclude_unset``): a role chunk with
``prompt_token_ids``/``prompt_text`` null, then one chunk per token with ``token_ids`` and
``kv_transfer_params`` null, the last with ``finish_reason``, ``stop_reason`` and
``weight_versions``; usage on every chunk with continuous usage (forced include-usage), and a
final ``choices: []`` usage chunk (``exclude_none``) when usage is included."""

from __future__ import annotations

import asyncio
import math
import time

from aiohttp import web

from loadtest.sim.config import SimConfig
from loadtest.sim.engine import ABORTED, WAITING, Engine, Seq
from loadtest.sim.protocol import dumps, make_usage


async def open_sse(
    request: web.Request, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """A prepared 200 ``text/event-stream`` response, as vLLM sends its streams."""
    resp = web.StreamResponse(
        status=200,
        headers={
            **(headers or {}),
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
        },
    )
    await resp.prepare(request)
    return resp


def _usage(prompt: int, completion: int, prompt_details: str = "") -> str:
    """``,"usage":{...}`` of a chunk with continuous usage (vLLM's UsageInfo, set fields only:
    prompt_tokens_details on the role chunk, completion_tokens_details null)."""
    return (
        f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion},{prompt_details}"completion_tokens_details":null}}'
    )


def _cached_details(s: Seq, details: bool, zero: bool) -> str:
    """The role chunk's ``prompt_tokens_details`` (omitted when vLLM's would be None)."""
    cached = s.usage_cached
    if not details or not (cached or zero):
        return ""
    return (
        f'"prompt_tokens_details":{{"cached_tokens":{cached},"created_cache_tokens":null,'
        '"multimodal_tokens":null},'
    )


class Streamer:
    """Writes one replica's streams; counts the open ones to pace them (``tick``)."""

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self.open = 0

    def tick(self) -> float:
        """Minimum gap between two writes of one stream after its first token: output that
        falls due in between is written together (still one SSE event per token). Grows with
        the number of open streams so a busy process stays cheap."""
        if self._config.instant:
            return 0.0
        return min(0.05, max(0.001, 0.001 * self.open / 8))

    async def write_error(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        model: str,
        headers: dict[str, str],
        error: dict[str, object],
    ) -> web.StreamResponse:
        """A stream that fails before its first token (a decode leg's KV load failed): vLLM's
        generator has sent the headers, chat its role chunk, then the error as one event."""
        resp = await open_sse(request, headers)
        parts = []
        if kind == "chat":
            head = dumps(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": None,
                    "prompt_text": None,
                }
            )
            parts.append(f"data: {head}\n\n")
        parts.append(f"data: {dumps(error)}\n\ndata: [DONE]\n\n")
        await resp.write("".join(parts).encode())
        await resp.write_eof()
        return resp

    async def write(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        model: str,
        seqs: list[Seq],
        include_usage: bool,
        headers: dict[str, str],
        *,
        engine: Engine,
        text: dict[int, str],
        details: bool,
        zero: bool,
        continuous: bool = False,
    ) -> web.StreamResponse:
        """Stream ``seqs`` (already submitted to ``engine``) as ``kind`` ("chat" or
        "completions") chunks; ``text`` maps token ids to their text; ``details`` / ``zero``
        shape ``usage`` as in :func:`loadtest.sim.protocol.make_usage`; ``continuous``: usage
        on every chunk."""
        resp = await open_sse(request, headers)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = (
            f'data: {{"id":{dumps(rid)},"object":"{obj}","created":{created},'
            f'"model":{dumps(model)},"choices":[{{"index":'
        )
        dt = engine.dt
        loop = asyncio.get_running_loop()
        n = len(seqs)
        emitted = [0] * n
        self.open += 1
        try:
            while True:
                now = loop.time()
                parts: list[str] = []
                next_due = math.inf
                next_is_first = False
                pending: list[asyncio.Future[None]] = []
                remaining = False
                for i, s in enumerate(seqs):
                    m = s.max_tokens
                    if emitted[i] >= m:
                        continue
                    if s.state == ABORTED:
                        return resp  # the replica is stopping; the connection is gone
                    if s.state == WAITING:
                        assert s.admitted is not None
                        pending.append(s.admitted)
                        remaining = True
                        continue
                    due = s.tokens_due(now, dt)
                    p = s.num_prompt_tokens
                    for k in range(emitted[i], due):
                        piece = dumps(text[s.output_ids[k]])
                        usage = _usage(p, k + 1) if continuous else ""
                        if kind == "chat":
                            if k == 0:
                                first = (
                                    _usage(p, 0, _cached_details(s, details, zero))
                                    if continuous
                                    else ""
                                )
                                parts.append(
                                    f'{head}{i},"delta":{{"role":"assistant",'
                                    f'"content":""}},"logprobs":null,'
                                    f'"finish_reason":null}}]{first},'
                                    f'"prompt_token_ids":null,"prompt_text":null}}\n\n'
                                )
                            tail = (
                                f'"finish_reason":"{s.end_reason}","stop_reason":null,'
                                '"token_ids":null,"weight_versions":null'
                                if k == m - 1
                                else '"finish_reason":null,"token_ids":null'
                            )
                            parts.append(
                                f'{head}{i},"delta":{{"content":{piece}}},'
                                f'"logprobs":null,{tail}}}]{usage},'
                                f'"kv_transfer_params":null}}\n\n'
                            )
                        else:
                            fin = f'"{s.end_reason}"' if k == m - 1 else "null"
                            parts.append(
                                f'{head}{i},"text":{piece},"logprobs":null,'
                                f'"finish_reason":{fin},"stop_reason":null}}]{usage}}}\n\n'
                            )
                    emitted[i] = due
                    if due < m:
                        remaining = True
                        t = s.due_at(due + 1, dt)
                        if t < next_due:
                            next_due, next_is_first = t, due == 0
                if parts:
                    await resp.write("".join(parts).encode())
                if not remaining:
                    break
                delay = next_due - loop.time()
                if not next_is_first:
                    delay = max(delay, self.tick())
                if pending:
                    await asyncio.wait(
                        pending,
                        timeout=None if next_due == math.inf else max(0.0, delay),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                elif delay > 0:
                    await asyncio.sleep(delay)
            # every token is out, so every sequence has finished in virtual time
            engine.advance(max(loop.time(), max(s.finish_at for s in seqs)))
            tail_parts = []
            if include_usage:
                usage = make_usage(
                    sum(s.num_prompt_tokens for s in seqs),
                    sum(s.max_tokens for s in seqs),
                    sum(s.usage_cached for s in seqs),
                    details,
                    zero,
                )
                if usage["prompt_tokens_details"] is None:
                    del usage["prompt_tokens_details"]  # unset fields are omitted in streams
                tail_parts.append(
                    "data: "
                    + dumps(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                    + "\n\n"
                )
            tail_parts.append("data: [DONE]\n\n")
            await resp.write("".join(tail_parts).encode())
            await resp.write_eof()
        finally:
            self.open -= 1
        return resp
