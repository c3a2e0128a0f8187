"""The Anthropic Messages and OpenAI Responses endpoints of a simulated replica, as vLLM
0.34.0 serves them: the body is converted to chat with the gateway's own converters
(router/api/), so the ids rendered here are the ones the gateway predicts, then generated
like a chat request and answered in the API's own shapes, usage and events.

Streams are written once the sequence has finished (the events and their order are vLLM's;
their pacing is not). Responses are stored per replica for ``previous_response_id``,
unless ``store`` is false; an unknown id is a 404, as vLLM answers."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any, Protocol

from aiohttp import web

from loadtest.sim.engine import ABORTED, FINISHED, Seq
from loadtest.sim.generate import Generation
from loadtest.sim.host import Host
from loadtest.sim.kvcache import block_hashes
from loadtest.sim.protocol import (
    OFFLOAD_BYTES,
    cache_salt,
    dumps,
    json_response,
    offload,
    read_json,
)
from loadtest.sim.stream import open_sse
from router.api import anthropic, responses
from router.core.errors import APIError

STORE_CAPACITY = 10_000


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {dumps(data)}\n\n"


class ApiHost(Host, Protocol):
    """The replica as the Messages and Responses handlers read it: generation's own steps
    too."""

    generation: Generation


class Apis:
    """Handlers bound to one replica."""

    def __init__(self, replica: ApiHost) -> None:
        self.r = replica
        # response id -> the chat messages of its conversation, the answer included
        self.store: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        # response id -> the response object, for GET /v1/responses/{id}
        self.objects: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def _run(
        self, request: web.Request, chat: dict[str, Any], size: int, body: dict[str, Any], kind: str
    ) -> tuple[Seq, dict[str, Any] | None]:
        """The sequence generated, and the KV transfer parameters a prefill leg answers."""
        self.r.faults.check()
        await self.r.faults.hang()
        gen = self.r.generation
        params, leg = gen._leg(body)  # kv_transfer_params, as on chat (vLLM 0.34 takes them)
        model, lora = self.r.resolve_model(body)
        salt = cache_salt(body)
        bs = self.r.config.block_size

        def prepare() -> tuple[list[int], list[bytes]]:
            ids = self.r.render_chat(chat)
            return ids, block_hashes(ids, bs, lora=lora, cache_salt=salt)

        ids, hashes = await offload(prepare, size > OFFLOAD_BYTES)
        max_tokens = gen._max_tokens(chat.get("max_tokens"), len(ids))
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        seq = gen._make_seq(
            rid,
            ids,
            hashes,
            max_tokens,
            lora,
            salt,
            {"endpoint": kind, "model": model},
            limited=chat.get("max_tokens") is not None,
        )
        gen._set_leg(seq, params, leg, bool(body.get("stream")))
        engine = self.r.engine
        engine.submit([seq])
        try:
            if leg == "decode":
                assert params is not None
                pulled = await gen._transfer(seq, params)
                if pulled is None:
                    raise APIError(500, "Internal server error", type_="InternalServerError")
                seq = pulled
            assert seq.done is not None
            await seq.done
        finally:
            if seq.state not in (FINISHED, ABORTED):
                engine.abort(seq)
        if seq.state != FINISHED:
            raise APIError(503, "The request was aborted: the replica is shutting down")
        nixl = self.r.nixl
        return seq, nixl.pinned(seq) if nixl is not None and seq.hold else None

    def _cached(self, seq: Seq) -> int:
        return seq.usage_cached if self.r.config.enable_prompt_tokens_details else 0

    # -- Anthropic Messages ---------------------------------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body, size = await read_json(request)
            chat = anthropic.to_chat(body)
            seq, kv_params = await self._run(request, chat, size, body, "messages")
        except APIError as e:
            return anthropic.error_response(e)
        model = body.get("model") or self.r.config.model
        mid = f"msg_{uuid.uuid4().hex}"
        text = self.r.generation._text(seq.output_ids)
        p, c, cached = seq.num_prompt_tokens, seq.max_tokens, self._cached(seq)
        # vLLM's _build_anthropic_usage: input_tokens excludes the cache read, which is
        # reported only with --enable-prompt-tokens-details.
        usage: dict[str, int] = {"input_tokens": p - cached, "output_tokens": c}
        if self.r.config.enable_prompt_tokens_details:
            usage["cache_read_input_tokens"] = cached
        stop = "max_tokens" if seq.finish_reason == "length" else "end_turn"
        if not body.get("stream"):
            return json_response(
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": text}],
                    "model": model,
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": usage,
                    "kv_transfer_params": kv_params,
                }
            )
        start = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": p, "output_tokens": 0},
        }
        events = [_sse("message_start", {"type": "message_start", "message": start})]
        block = {"type": "text", "text": ""}
        events.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        )
        words = self.r.words.text
        for t in seq.output_ids:
            delta = {"type": "text_delta", "text": words[t]}
            events.append(
                _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            )
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        events.append(
            _sse(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": usage},
            )
        )
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return await self._stream(request, events)

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body, size = await read_json(request)
            chat = anthropic.to_chat(body, count_tokens=True)
            self.r.resolve_model(body)
            ids = await offload(lambda: self.r.render_chat(chat), size > OFFLOAD_BYTES)
        except APIError as e:
            return anthropic.error_response(e)
        return json_response({"input_tokens": len(ids)})

    # -- OpenAI Responses -----------------------------------------------------------------
    def _stored(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        response_id = request.match_info["response_id"]
        found = self.objects.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.")
        return response_id, found

    async def retrieve(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}`` (vLLM's retrieve_responses)."""
        return json_response(self._stored(request)[1])

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: only a background response can be cancelled,
        and this replica runs none (vLLM's cancel_responses)."""
        self._stored(request)
        raise APIError(400, "Cannot cancel a synchronous response.")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body, size = await read_json(request)
        chat = responses.to_chat(body)
        previous = body.get("previous_response_id")
        if previous is not None:
            history = self.store.get(str(previous))
            if history is None:
                raise APIError(
                    404, f"Response with id '{previous}' not found.", param="previous_response_id"
                )
            # Instructions do not carry over: the earlier turns without their system message.
            system = [
                m
                for m in chat["messages"][:1]
                if m["role"] == "system" and body.get("instructions")
            ]
            rest = chat["messages"][len(system) :]
            chat = {
                **chat,
                "messages": system + [m for m in history if m["role"] != "system"] + rest,
            }
        seq, kv_params = await self._run(request, chat, size, body, "responses")
        model = body.get("model") or self.r.config.model
        # vLLM takes the body's request_id as the response's id (and overwrites what its
        # store held under it): its store is not tenant-aware.
        resp_id = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
        text = self.r.generation._text(seq.output_ids)
        store = body.get("store", True)
        if store:
            self.store[resp_id] = chat["messages"] + [{"role": "assistant", "content": text}]
            while len(self.store) > STORE_CAPACITY:
                self.store.popitem(last=False)
        p, c, cached = seq.num_prompt_tokens, seq.max_tokens, self._cached(seq)
        usage = {
            "input_tokens": p,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + c,
        }
        msg_id = f"msg_{uuid.uuid4().hex}"
        # The shapes and order of vLLM 0.34's simple (non-harmony) stream:
        # responses/streaming_events.py emit_simple_content_open / _delta / _done, framed by
        # serving.py responses_stream_generator (created, in_progress ... completed, or
        # incomplete when the token limit cut the answer).
        status = "incomplete" if seq.finish_reason == "length" else "completed"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        message = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if text else [],
        }
        full = {
            "id": resp_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "output": [message],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "previous_response_id": previous,
            "usage": usage,
            "kv_transfer_params": kv_params,
        }
        if store:
            self.objects[resp_id] = full
            while len(self.objects) > STORE_CAPACITY:
                self.objects.popitem(last=False)
        if not body.get("stream"):
            return json_response(full)
        created = {
            **full,
            "status": "in_progress",
            "incomplete_details": None,
            "output": [],
            "usage": None,
        }
        seqno = iter(range(1_000_000))

        def event(kind: str, **fields: Any) -> str:
            return _sse(kind, {"type": kind, "sequence_number": next(seqno), **fields})

        at = {"output_index": 0, "item_id": msg_id, "content_index": 0}
        events = [
            event("response.created", response=created),
            event("response.in_progress", response=created),
            event(
                "response.output_item.added",
                output_index=0,
                item={**message, "status": "in_progress", "content": []},
            ),
            event(
                "response.content_part.added",
                **at,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]
        words = self.r.words.text
        for t in seq.output_ids:
            events.append(event("response.output_text.delta", **at, delta=words[t], logprobs=[]))
        events += [
            event("response.output_text.done", **at, text=text, logprobs=[]),
            event("response.content_part.done", **at, part=part),
            event("response.output_item.done", output_index=0, item=message),
            event(f"response.{status}", response=full),
        ]
        return await self._stream(request, events)

    async def _stream(self, request: web.Request, events: list[str]) -> web.StreamResponse:
        resp = await open_sse(request)
        for ev in events:
            await resp.write(ev.encode())
        await resp.write_eof()
        return resp
