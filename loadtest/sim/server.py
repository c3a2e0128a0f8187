"""One simulated vLLM server: its lifecycle (start, stop like a killed process, restart
empty), the hooks tests use to inject faults and wait for engine states, and the aiohttp app
that routes to the handlers (``loadtest.sim.generate``, ``loadtest.sim.endpoints``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from loadtest.sim.apis import Apis
from loadtest.sim.config import SimConfig
from loadtest.sim.endpoints import Endpoints
from loadtest.sim.engine import Engine, new_stats
from loadtest.sim.faults import Faults
from loadtest.sim.generate import Generation
from loadtest.sim.kv_events import KVEventPublisher
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.nixl import SIDE_CHANNEL_PATH, Link, NixlConnector
from loadtest.sim.protocol import json_response
from loadtest.sim.stream import Streamer
from loadtest.sim.tokens import Words, get_renderer, get_vllm_chat, get_words
from loadtest.sim.vllm_chat import Unsupported, VllmChat
from router.core.errors import APIError, bad_request
from router.prompt import Renderer

log = logging.getLogger("loadtest.sim")


class SimReplica:
    """One simulated vLLM server. ``await start()``, then talk HTTP to ``url``.

    For tests: ``stats`` is a live dict — ``requests`` (generation requests that reached the
    engine), ``queries`` / ``hits`` (prompt / cached tokens, as vLLM's prefix-cache counters),
    ``prompt_tokens``, ``generation_tokens``, ``finished``, ``aborted``,
    ``injected_failures``, ``errors`` (4xx/5xx answered) and ``records``, one dict per
    finished or aborted engine request (request_id, endpoint, model, lora, cache_salt,
    prompt_tokens, cached_tokens, completion_tokens, finish_reason, arrival, queue_s, ttft_s,
    e2e_s; times are the simulation's). ``engine`` exposes the scheduler and block pool.
    ``fail_next`` / ``hang_next`` / ``health_status`` inject faults; ``wait_idle`` / ``wait_for`` wait for
    engine states without sleeping.
    """

    def __init__(self, config: SimConfig | None = None, renderer: Renderer | None = None) -> None:
        self.config = config or SimConfig()
        # A shared renderer carries the tokenizer's own template: not this replica's override.
        self._renderer = renderer if self.config.chat_template is None else None
        self._chat: VllmChat | None = None
        self._words: Words | None = None
        self.stats: dict[str, Any] = new_stats()
        self.health_status = 200
        self.url = ""
        self.host: str | None = None
        self.port: int | None = None
        self.faults = Faults(self.stats)
        self.streamer = Streamer(self.config)
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._started_once = False
        self.kv_events: KVEventPublisher | None = None
        self._kv_bound: tuple[str, str | None] | None = None  # kept across restarts
        self._new_engine()

    def _new_engine(self) -> None:
        c = self.config
        self.metrics = SimMetrics(
            model=c.model, block_size=c.block_size, num_gpu_blocks=c.num_gpu_blocks
        )
        self.engine = Engine(
            block_size=c.block_size,
            num_gpu_blocks=c.num_gpu_blocks,
            prefill_tokens_per_s=c.prefill_tokens_per_s,
            decode_tokens_per_s=c.decode_tokens_per_s,
            decode_cost_tokens=c.decode_cost_tokens,
            request_overhead_s=c.request_overhead_s,
            max_num_seqs=c.max_num_seqs,
            instant=c.instant,
            metrics=self.metrics,
            stats=self.stats,
            on_kv_events=self._publish_kv_events if c.kv_events_endpoint else None,
            lora_ids={name: i + 1 for i, name in enumerate(c.lora_adapters)},
            transfer=Link(c) if c.kv_connector else None,
            cpu_offload_blocks=c.cpu_offload_blocks,
            cpu_load_cost=c.cpu_load_cost,
        )
        # A new process: a new NIXL engine id, nothing pinned.
        self.nixl = NixlConnector(c, self.engine, lambda: self.port) if c.kv_connector else None

    def _publish_kv_events(self, events: list[dict[str, Any]]) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(events)

    # ------------------------------------------------------------------ lifecycle

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = get_renderer(self.config.tokenizer, self.config.chat_template)
        return self._renderer

    @property
    def chat(self) -> VllmChat:
        """The replica's own chat rendering, loaded as vLLM loads it (not the gateway's)."""
        if self._chat is None:
            self._chat = get_vllm_chat(self.config.tokenizer, self.config.chat_template)
        return self._chat

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0 = any free port); returns the base URL. A replica that
        was stopped starts again empty, like a restarted process."""
        if self._runner is not None:
            raise RuntimeError("replica already started")
        if self._renderer is None:
            self._renderer = await asyncio.to_thread(
                get_renderer, self.config.tokenizer, self.config.chat_template
            )
        if self._chat is None:
            self._chat = await asyncio.to_thread(
                get_vllm_chat, self.config.tokenizer, self.config.chat_template
            )
        if self._words is None:
            self._words = await asyncio.to_thread(get_words, self._renderer)
        if self._started_once:
            self._new_engine()
        self._started_once = True
        c = self.config
        runner = web.AppRunner(
            self._build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.25
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site
        if c.kv_events_endpoint:
            await self._start_kv_events()
        self.host = host
        self.port = int(runner.addresses[0][1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        return self.url

    async def _start_kv_events(self) -> None:
        c = self.config
        endpoint, replay = self._kv_bound or (
            c.kv_events_endpoint or "",
            c.kv_events_replay_endpoint,
        )
        pub = KVEventPublisher(
            endpoint, replay, topic=c.kv_events_topic, buffer_steps=c.kv_events_buffer_steps
        )
        await pub.start()
        self.kv_events = pub
        # A restarted replica publishes on the same ports (a new process, seq from 0).
        self._kv_bound = (pub.endpoint, pub.replay_endpoint)

    async def stop_kv_events(self) -> None:
        """Close the KV event sockets only (a publisher that went away)."""
        pub, self.kv_events = self.kv_events, None
        if pub is not None:
            await pub.close()

    async def stop(self) -> None:
        """Close the listening socket and abort every open connection (like a killed
        process); in-flight requests are aborted and their blocks freed."""
        runner, site = self._runner, self._site
        if runner is None:
            return
        await self.stop_kv_events()
        self._runner = self._site = None
        if site is not None:
            with contextlib.suppress(Exception):
                await site.stop()
        server = runner.server
        if server is not None:
            for handler in server.connections:
                transport = handler.transport
                if transport is not None:
                    transport.abort()
        self.engine.abort_all()
        if self.nixl is not None:
            await self.nixl.close()
        await asyncio.sleep(0)  # let connection_lost cancel the handlers
        with contextlib.suppress(Exception):
            await runner.cleanup()

    # ------------------------------------------------------------------ test hooks

    def add_adapter(self, name: str) -> None:
        """Serve LoRA adapter ``name`` from now on (runtime loading)."""
        # A new config: replicas started from one SimConfig must not all get the adapter.
        self.config = dataclasses.replace(
            self.config, lora_adapters=[*self.config.lora_adapters, name]
        )
        self.engine.lora_ids.setdefault(name, len(self.engine.lora_ids) + 1)
        self.stats["adapters_loaded"] = self.stats.get("adapters_loaded", 0) + 1

    def fail_next(self, n: int, status: int = 503) -> None:
        """The next ``n`` generation (or /tokenize) requests answer ``status`` before any byte."""
        self.faults.fail_next(n, status)

    def hang_next(self, n: int) -> None:
        """The next ``n`` generation (or /tokenize) requests are accepted and never answered, until the
        client drops the connection or the replica stops (a wedged server)."""
        self.faults.hang_next(n)

    @property
    def hanging(self) -> int:
        """Requests being held unanswered now (``hang_next``)."""
        return self.faults.hanging

    def reset_cache(self) -> None:
        """Forget every cached block not in use by a running request."""
        self.engine.reset_cache()

    async def wait_idle(self, timeout: float | None = 10.0) -> None:
        """Wait until no request is waiting or running."""
        await self.engine.wait_for(self.engine.idle, timeout)

    async def wait_for(
        self, predicate: Callable[[SimReplica], bool], timeout: float | None = 10.0
    ) -> None:
        """Wait until ``predicate(self)`` holds (re-checked on every engine state change)."""
        await self.engine.wait_for(lambda: predicate(self), timeout)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) now, as the metrics report them."""
        return self.engine.counts()

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.pool.usage()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> web.Application:
        gen, other, apis = Generation(self), Endpoints(self), Apis(self)
        self.generation, self.apis = gen, apis
        app = web.Application(client_max_size=256 * 2**20, middlewares=[self._middleware])
        r = app.router
        r.add_post("/v1/chat/completions", gen.chat)
        r.add_post("/v1/completions", gen.completions)
        r.add_get("/v1/models", other.models)
        r.add_post("/tokenize", other.tokenize)
        r.add_post("/detokenize", other.detokenize)
        r.add_get("/health", other.health)
        r.add_get("/version", other.version)
        r.add_get("/metrics", other.metrics)
        r.add_post("/reset_prefix_cache", other.reset_prefix_cache)
        if self.config.allow_runtime_lora:
            r.add_post("/v1/load_lora_adapter", other.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", other.unload_lora_adapter)
        r.add_post("/v1/messages", apis.messages)
        r.add_post("/v1/messages/count_tokens", apis.count_tokens)
        r.add_post("/v1/responses", apis.responses)
        r.add_get("/v1/responses/{response_id}", apis.retrieve)
        r.add_post("/v1/responses/{response_id}/cancel", apis.cancel)
        if self.nixl is not None:
            r.add_post(SIDE_CHANNEL_PATH, self._side_channel)
        app.on_response_prepare.append(_echo_request_id)
        return app

    async def _side_channel(self, request: web.Request) -> web.Response:
        """NIXL's side channel (a decode replica reads, heartbeats or frees a prefill leg's
        blocks): loadtest.sim.nixl."""
        assert self.nixl is not None
        msg = await request.json()
        status, answer = self.nixl.side_channel(msg if isinstance(msg, dict) else {})
        return json_response(answer, status=status)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            self.stats["errors"] += 1
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # FastAPI's shape for routing errors, as vLLM answers them.
            headers = {
                k: v
                for k, v in e.headers.items()
                if k.lower() not in ("content-type", "content-length")
            }
            return json_response({"detail": e.reason}, e.status, headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # never let a bug take the replica down
            log.exception("internal error on %s %s", request.method, request.path)
            self.stats["errors"] += 1
            return APIError(500, f"Internal server error: {type(e).__name__}: {e}").response()

    # ------------------------------------------------------------------ shared by the handlers

    @property
    def words(self) -> Words:
        return self._words or get_words(self.renderer)

    def resolve_model(self, body: dict[str, Any]) -> tuple[str, str | None]:
        m = body.get("model")
        c = self.config
        if m is None:
            return c.model, None
        if not isinstance(m, str):
            raise bad_request("model must be a string", "model")
        if m == c.model:
            return m, None
        if m in c.lora_adapters:
            return m, m
        raise APIError(
            404, f"The model `{m}` does not exist.", param="model", type_="NotFoundError"
        )

    def render_chat(self, body: dict[str, Any]) -> list[int]:
        try:
            return self.chat.tokenize_chat(body)
        except Unsupported:
            pass  # beyond the plain subset: the full renderer (it also says what is wrong)
        except Exception:
            pass  # a template error: the full renderer gives vLLM's 400 for it
        try:
            ids = self.renderer.tokenize_chat(body)
        except APIError:
            raise
        except Exception as e:  # template or content errors are the client's
            raise bad_request(
                f"Could not render the chat request: {type(e).__name__}: {e}", "messages"
            ) from None
        return list(ids)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                return list(self.renderer.tokenize_completion(prompt))
            except APIError:
                raise
            except Exception as e:
                raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None
        self.check_ids(prompt, "prompt")
        return list(prompt)

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        words = self.words
        bad = [t for t in ids if t < 0 or t > words.max_token_id]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary", param)


# ---------------------------------------------------------------------- helpers for users


@asynccontextmanager
async def run_replicas(
    n: int, config: SimConfig | None = None, *, renderer: Renderer | None = None, **overrides: Any
) -> AsyncIterator[list[SimReplica]]:
    """Start ``n`` replicas on free loopback ports, all sharing one tokenizer (``renderer``, or
    the process-wide one for ``config.tokenizer``); stop them on exit. ``overrides`` replace
    fields of ``config``."""
    cfg = dataclasses.replace(config or SimConfig(), **overrides)
    if renderer is None:
        renderer = await asyncio.to_thread(get_renderer, cfg.tokenizer, cfg.chat_template)
    await asyncio.to_thread(get_vllm_chat, cfg.tokenizer, cfg.chat_template)
    await asyncio.to_thread(get_words, renderer)
    replicas = [SimReplica(cfg, renderer) for _ in range(n)]
    try:
        for r in replicas:
            await r.start()
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer names the request it answers, as vLLM's with --enable-request-id-headers
    (the gateway checks it on pooled connections)."""
    rid = request.headers.get("X-Request-Id")
    if rid and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = rid
