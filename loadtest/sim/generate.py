"""The generation endpoints of a simulated replica: ``/v1/chat/completions`` and
``/v1/completions``. A request is validated as vLLM validates it, tokenized and hashed into
vLLM's block hashes, submitted to the engine and answered whole or streamed
(``loadtest.sim.stream``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from loadtest.sim.engine import ABORTED, FINISHED, Seq
from loadtest.sim.host import Host
from loadtest.sim.kvcache import block_hashes
from loadtest.sim.nixl import (
    is_decode_leg,
    is_prefill_leg,
    reported_cached,
    transfer_params,
)
from loadtest.sim.protocol import (
    OFFLOAD_BYTES,
    OFFLOAD_TOKENS,
    cache_salt,
    completion_prompts,
    continuous_usage,
    json_response,
    make_usage,
    offload,
    opt_int,
    read_json,
    stream_options,
)
from router.core.errors import APIError, bad_request
from router.intake.parse import skips_cache_read


class Generation:
    """Request handlers bound to one replica (its config, engine, tokenizer and faults)."""

    def __init__(self, replica: Host) -> None:
        self.r = replica

    def _max_tokens(self, requested: int | None, p: int) -> int:
        c = self.r.config
        if p == 0:
            raise bad_request("The decoder prompt cannot be empty", "prompt")
        if requested is None:
            if p >= c.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {c.max_model_len} tokens. "
                    f"However, your request has {p} input tokens. Please reduce the length "
                    "of the input messages.",
                    "messages",
                )
            m = min(c.max_tokens_default, c.max_model_len - p)
        else:
            m = requested
            if p + m > c.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {c.max_model_len} tokens. "
                    f"However, you requested {p + m} tokens ({p} in the messages, {m} in "
                    "the completion). Please reduce the length of the messages or "
                    "completion.",
                    "max_tokens",
                )
        need = self.r.engine.blocks_needed(p, m)
        if need > c.num_gpu_blocks:
            raise bad_request(
                f"The request needs {need} KV cache blocks ({p} prompt + {m} output tokens, "
                f"block size {c.block_size}) but the replica has only {c.num_gpu_blocks}.",
                "max_tokens",
            )
        return m

    def _make_seq(
        self,
        request_id: str,
        ids: list[int],
        hashes: list[bytes],
        max_tokens: int,
        lora: str | None,
        salt: str | None,
        meta: dict[str, Any],
        limited: bool = True,
    ) -> Seq:
        """``limited``: the request set a token limit (the answer stops at it: "length");
        without one the simulated answer ends on its own after ``max_tokens`` ("stop")."""
        words = self.r.words
        out = words.sample(self.r.config.seed, ids, max_tokens)
        end = "length" if limited else "stop"
        return Seq(
            request_id, ids, out, hashes, lora=lora, cache_salt=salt, meta=meta, end_reason=end
        )

    def _leg(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """(kv_transfer_params, "prefill" | "decode" | None): the leg of a disaggregated
        request this replica serves; None without a KV connector or for a plain request."""
        params = transfer_params(body)
        if self.r.nixl is None:
            return params, None
        if is_prefill_leg(params):
            return params, "prefill"
        return params, "decode" if is_decode_leg(params) else None

    def _given_ids(self, params: dict[str, Any] | None, leg: str | None) -> list[int] | None:
        """A decode leg's prompt ids sent by the proxy (``kv_transfer_params.prompt_token_ids``:
        vLLM 0.34 then skips rendering and tokenizing)."""
        ids = params.get("prompt_token_ids") if params and leg == "decode" else None
        if ids is None:
            return None
        param = "kv_transfer_params.prompt_token_ids"
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise bad_request("prompt_token_ids must be a list of token ids", param)
        self.r.check_ids(ids, param)
        return ids

    def _set_leg(
        self, seq: Seq, params: dict[str, Any] | None, leg: str | None, stream: bool
    ) -> Seq:
        """Mark ``seq`` as its leg: a prefill leg answered whole pins its blocks; a decode leg
        pulls from ``remote_engine_id``; usage reports the prefill side's cached count."""
        seq.hold = leg == "prefill" and not stream
        if leg == "decode":
            assert params is not None
            seq.remote_engine = str(params["remote_engine_id"])
        seq.reported_cached = reported_cached(params)
        return seq

    def _text(self, ids: Sequence[int]) -> str:
        words = self.r.words
        return "".join(words.text[t] for t in ids)

    def _request_id(self, request: web.Request) -> str:
        rid = request.headers.get("X-Request-Id")
        return rid if rid else uuid.uuid4().hex

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.r.faults.check()
        await self.r.faults.hang()
        body, size = await read_json(request)
        model, lora = self.r.resolve_model(body)
        salt = cache_salt(body)
        force = self.r.config.enable_force_include_usage
        stream, include_usage = stream_options(body, force)
        continuous = continuous_usage(body, force)
        mct = opt_int(body, "max_completion_tokens", 1)
        mt = opt_int(body, "max_tokens", 1)
        opt_int(body, "n", 1)
        bs = self.r.config.block_size
        params, leg = self._leg(body)
        try:
            given = self._given_ids(params, leg)

            def prepare() -> tuple[list[int], list[bytes]]:
                ids = given if given is not None else self.r.render_chat(body)
                return ids, block_hashes(ids, bs, lora=lora, cache_salt=salt)

            ids, hashes = await offload(prepare, size > OFFLOAD_BYTES)
            max_tokens = self._max_tokens(mct or mt, len(ids))
        except APIError:
            await self._rejected(params, leg)
            raise
        base = self._request_id(request)
        rid = f"chatcmpl-{base}"
        meta = {
            "endpoint": "chat",
            "model": model,
            "skip_cache_read": skips_cache_read(body, "chat"),
        }
        seq = self._make_seq(
            rid, ids, hashes, max_tokens, lora, salt, meta, limited=(mct or mt) is not None
        )
        self._set_leg(seq, params, leg, stream)
        return await self._generate(
            request,
            "chat",
            rid,
            base,
            model,
            [seq],
            stream,
            include_usage,
            continuous,
            params=params,
            leg=leg,
            token_ids=body.get("return_token_ids") is True,
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.r.faults.check()
        await self.r.faults.hang()
        body, size = await read_json(request)
        model, lora = self.r.resolve_model(body)
        salt = cache_salt(body)
        force = self.r.config.enable_force_include_usage
        stream, include_usage = stream_options(body, force)
        continuous = continuous_usage(body, force)
        mt = opt_int(body, "max_tokens", 1)
        opt_int(body, "n", 1)
        bs = self.r.config.block_size
        params, leg = self._leg(body)
        given = self._given_ids(params, leg)
        by_request = getattr(self.r.renderer, "tokenize_completion_request", None)
        if by_request is None:  # an older Renderer: parse the prompt forms here
            if body.get("suffix"):
                raise bad_request("suffix is not supported", "suffix")
            prompts = completion_prompts(body.get("prompt"))
        prompt = body.get("prompt")
        n_tokens_hint = len(prompt) if isinstance(prompt, list) else 0

        def prepare() -> list[tuple[list[int], list[bytes]]]:
            try:
                if given is not None:
                    all_ids = [given]
                elif by_request is not None:
                    all_ids = [list(ids) for ids in by_request(body)]
                else:
                    all_ids = [self.r.tokenize_prompt(p) for p in prompts]
            except APIError:
                raise
            except Exception as e:
                raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None
            return [(ids, block_hashes(ids, bs, lora=lora, cache_salt=salt)) for ids in all_ids]

        heavy = size > OFFLOAD_BYTES or n_tokens_hint > OFFLOAD_TOKENS
        try:
            prepared = await offload(prepare, heavy)
            if leg is not None and len(prepared) != 1:
                raise bad_request("a disaggregated request takes one prompt", "prompt")
            limits = [self._max_tokens(mt, len(ids)) for ids, _ in prepared]
        except APIError:
            await self._rejected(params, leg)
            raise
        base = self._request_id(request)
        rid = f"cmpl-{base}"
        seqs = []
        for i, ((ids, hashes), m) in enumerate(zip(prepared, limits, strict=True)):
            sid = rid if len(prepared) == 1 else f"{rid}-{i}"
            seqs.append(
                self._make_seq(
                    sid,
                    ids,
                    hashes,
                    m,
                    lora,
                    salt,
                    {
                        "endpoint": "completions",
                        "model": model,
                        "skip_cache_read": skips_cache_read(body, "completions"),
                    },
                    limited=mt is not None,
                )
            )
        for seq in seqs:
            self._set_leg(seq, params, leg, stream)
        return await self._generate(
            request,
            "completions",
            rid,
            base,
            model,
            seqs,
            stream,
            include_usage,
            continuous,
            params=params,
            leg=leg,
            token_ids=body.get("return_token_ids") is True,
        )

    async def _rejected(self, params: dict[str, Any] | None, leg: str | None) -> None:
        if leg == "decode" and self.r.nixl is not None:
            await self.r.nixl.notify_rejected(params)

    async def _transfer(self, seq: Seq, params: dict[str, Any]) -> Seq | None:
        """A decode leg, submitted: wait for its admission (heartbeating the prefill side),
        then pull. Returns the sequence that goes on (the same one, or with the "recompute"
        policy a new one computing the prompt itself), None when the load failed."""
        nixl, engine = self.r.nixl, self.r.engine
        assert nixl is not None
        await nixl.wait_admitted(seq, params)
        if seq.state == ABORTED or await nixl.pull(seq, params):
            return seq
        engine.abort(seq)
        if self.r.config.kv_load_failure_policy != "recompute":
            return None
        again = Seq(
            seq.request_id,
            seq.prompt_ids,
            seq.output_ids,
            seq.hashes[: len(seq.prompt_ids) // self.r.config.block_size],
            lora=seq.lora,
            cache_salt=seq.cache_salt,
            meta=seq.meta,
            end_reason=seq.end_reason,
        )
        again.reported_cached = seq.reported_cached
        engine.submit([again])
        return again

    async def _generate(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        base_id: str,
        model: str,
        seqs: list[Seq],
        stream: bool,
        include_usage: bool,
        continuous: bool = False,
        *,
        params: dict[str, Any] | None = None,
        leg: str | None = None,
        token_ids: bool = False,
    ) -> web.StreamResponse:
        headers = {"X-Request-Id": base_id}
        engine = self.r.engine
        engine.submit(seqs)
        try:
            if leg == "decode":
                assert params is not None
                pulled = await self._transfer(seqs[0], params)
                if pulled is None:
                    return await self._load_failed(request, kind, rid, model, stream, headers)
                seqs = [pulled]
            if stream:
                return await self.r.streamer.write(
                    request,
                    kind,
                    rid,
                    model,
                    seqs,
                    include_usage,
                    headers,
                    engine=engine,
                    text=self.r.words.text,
                    details=self.r.config.enable_prompt_tokens_details,
                    zero=self.r.config.always_report_cached_tokens,
                    continuous=continuous,
                )
            for s in seqs:
                assert s.done is not None
                await s.done
        finally:
            for s in seqs:
                if s.state not in (FINISHED, ABORTED):
                    engine.abort(s)
        if any(s.state != FINISHED for s in seqs):
            raise APIError(503, "The request was aborted: the replica is shutting down")
        created = int(time.time())
        details = self.r.config.enable_prompt_tokens_details
        p = sum(s.num_prompt_tokens for s in seqs)
        c = sum(s.max_tokens for s in seqs)
        cached = sum(s.usage_cached for s in seqs)
        usage = make_usage(p, c, cached, details, self.r.config.always_report_cached_tokens)
        # A prefill leg that finished pins its blocks and tells the decode leg where they are.
        nixl = self.r.nixl
        kv_params = nixl.pinned(seqs[0]) if nixl is not None and seqs[0].hold else None
        resp: dict[str, Any]
        if kind == "chat":
            s = seqs[0]
            resp = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": self._text(s.output_ids),
                            "reasoning_content": None,
                            "tool_calls": [],
                        },
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                    }
                ],
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": kv_params,
            }
            if token_ids:  # return_token_ids (vLLM's chat protocol)
                resp["prompt_token_ids"] = s.prompt_ids
                resp["choices"][0]["token_ids"] = s.output_ids
        else:
            resp = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": i,
                        "text": self._text(s.output_ids),
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                    for i, s in enumerate(seqs)
                ],
                "usage": usage,
                "kv_transfer_params": kv_params,
            }
            if token_ids:
                for choice, s in zip(resp["choices"], seqs, strict=True):
                    choice["prompt_token_ids"] = s.prompt_ids
                    choice["token_ids"] = s.output_ids
        return json_response(resp, headers=headers)

    async def _load_failed(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        model: str,
        stream: bool,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """kv_load_failure_policy "fail": the request ends with finish_reason "error", which
        vLLM answers as a 500 (a stream: 200, then an error event; chat sends its role chunk
        first)."""
        self.r.stats["errors"] += 1
        error = APIError(500, "Internal server error", type_="InternalServerError")
        if not stream:
            return json_response(error.body(), status=500, headers=headers)
        return await self.r.streamer.write_error(request, kind, rid, model, headers, error.body())
