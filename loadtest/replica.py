"""A simulated vLLM replica: vLLM's OpenAI-compatible HTTP surface, its prefix cache and a
timing model, without a GPU.

Used by the tests, the demo and the load-test harness as the ground truth the router is judged
against, so the prefix cache (``loadtest.sim.kvcache``) is written independently of
``router.blocks`` and follows vLLM's rules exactly; see ``loadtest.sim.engine`` for the
scheduling and timing model.

    async with run_replicas(3, block_size=16) as replicas:
        urls = [r.url for r in replicas]

    python -m loadtest.replica --port 9001 --count 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import signal
import sys
import threading
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash
from aiohttp import web

from loadtest.sim.engine import ABORTED, FINISHED, WAITING, Engine, Seq, new_stats
from loadtest.sim.kvcache import block_hashes
from loadtest.sim.metrics import SimMetrics
from router.bundled import tokenizer_dir
from router.errors import APIError, bad_request
from router.prompt import Renderer

__all__ = [
    "SimConfig",
    "SimReplica",
    "run_replicas",
    "get_renderer",
    "main",
    "DEFAULT_TOKENIZER",
    "VLLM_VERSION",
]

log = logging.getLogger("loadtest.replica")

DEFAULT_TOKENIZER = str(tokenizer_dir())
VLLM_VERSION = "0.34.0"
_T = TypeVar("_T")

# Work above this many request bytes (or prompt tokens) is done in a thread so a long prompt
# does not stall the other replicas sharing the event loop.
_OFFLOAD_BYTES = 16_384
_OFFLOAD_TOKENS = 4_096
_SALT_FORBIDDEN = frozenset("@/\\\x00")


@dataclass
class SimConfig:
    model: str = "Qwen/Qwen3-0.6B"
    tokenizer: str = DEFAULT_TOKENIZER
    block_size: int = 16
    num_gpu_blocks: int = 4096  # finite pool, LRU eviction of free cached blocks
    prefill_tokens_per_s: float = 200_000.0  # uncached prompt tokens/s, one FIFO per replica
    decode_tokens_per_s: float = 2_000.0  # per running sequence
    request_overhead_s: float = 0.0005  # fixed, per request, before the first token
    max_tokens_default: int = 16  # when the request gives no max_tokens/max_completion_tokens
    max_num_seqs: int = 256
    max_model_len: int = 40960
    lora_adapters: list[str] = field(default_factory=list)  # extra cards, parent = model
    enable_prompt_tokens_details: bool = True
    # vLLM attaches prompt_tokens_details only when cached_tokens > 0 (null / absent on a
    # miss); True reports {"cached_tokens": 0} on a miss too.
    # vLLM 0.34 reports {cached_tokens: 0} on a miss; older releases sent null there.
    always_report_cached_tokens: bool = True
    instant: bool = False  # all timing zero (overhead benchmarks)
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "num_gpu_blocks",
            "max_tokens_default",
            "max_num_seqs",
            "max_model_len",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SimConfig.{name} must be a positive integer, got {v!r}")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"SimConfig.{name} must be a positive number, got {v!r}")
        if not (
            isinstance(self.request_overhead_s, (int, float))
            and 0 <= self.request_overhead_s < math.inf
        ):
            raise ValueError("SimConfig.request_overhead_s must be >= 0")
        self.lora_adapters = list(self.lora_adapters)
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot have the base model's name")


# ---------------------------------------------------------------------- shared tokenizers

_RENDERERS: dict[str, Renderer] = {}
_WORDS: dict[int, tuple[Renderer, _Words]] = {}
_LOAD_LOCK = threading.Lock()


def get_renderer(tokenizer: str = DEFAULT_TOKENIZER) -> Renderer:
    """One ``Renderer`` per tokenizer per process (loading one costs seconds)."""
    p = Path(tokenizer)
    key = str(p.resolve()) if p.exists() else tokenizer
    r = _RENDERERS.get(key)
    if r is not None:
        return r
    with _LOAD_LOCK:
        r = _RENDERERS.get(key)
        if r is None:
            r = Renderer.from_pretrained(key, segment_cache=False)
            _RENDERERS[key] = r
    return r


class _Words:
    """Output tokens: ordinary lower-case words (``" word"`` pieces) that round-trip through
    the tokenizer, so an answer sent back as the next turn's history re-tokenizes to the very
    ids that were generated and cached."""

    def __init__(self, renderer: Renderer) -> None:
        tok = renderer.tokenizer
        vocab: dict[str, int] = tok.get_vocab()
        self.max_token_id = max(max(vocab.values()), len(tok) - 1)
        ids: list[int] = []
        for marker in ("\u0120", "\u2581"):  # byte-level BPE "Ġ", sentencepiece "▁"
            cands = sorted(
                i
                for piece, i in vocab.items()
                if piece.startswith(marker)
                and 3 <= len(piece) - 1 <= 10
                and piece[1:].isascii()
                and piece[1:].isalpha()
                and piece[1:].islower()
            )
            ids = self._verified(renderer, cands[:3000])
            if len(ids) >= 64:
                break
        if len(ids) < 16:  # an unusual tokenizer: any ids that decode to something visible
            ids = [
                i
                for i in range(min(1000, self.max_token_id), min(3000, self.max_token_id))
                if renderer.decode([i]).strip()
            ][:1024] or [0]
        self.ids = ids[:1024]
        self.text = {i: renderer.decode([i]) for i in self.ids}

    @staticmethod
    def _verified(renderer: Renderer, cands: list[int]) -> list[int]:
        if not cands:
            return []
        tok = renderer.tokenizer
        texts = [renderer.decode([i]) for i in cands]
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        return [
            i
            for i, t, e in zip(cands, texts, encoded, strict=True)
            if list(e) == [i] and t.startswith(" ") and t[1:].isalpha()
        ]

    def sample(self, seed: int, prompt_ids: Sequence[int], n: int) -> list[int]:
        key = array("q", prompt_ids).tobytes()
        rng = random.Random(hash_seed(seed, key))
        return rng.choices(self.ids, k=n)


def hash_seed(seed: int, data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=seed & 0xFFFFFFFFFFFFFFFF)


def _get_words(renderer: Renderer) -> _Words:
    entry = _WORDS.get(id(renderer))
    if entry is not None and entry[0] is renderer:
        return entry[1]
    with _LOAD_LOCK:
        entry = _WORDS.get(id(renderer))
        if entry is None or entry[0] is not renderer:
            entry = (renderer, _Words(renderer))
            _WORDS[id(renderer)] = entry
    return entry[1]


# ---------------------------------------------------------------------- request validation


def _opt_int(body: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    """An optional integer field, read as pydantic's lax mode reads one (integral floats are
    accepted, bools and strings are not)."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer, got {type(v).__name__}", key)
    if minimum is not None and v < minimum:
        raise bad_request(f"{key} must be at least {minimum}, got {v}.", key)
    return v


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    """An optional boolean field, pydantic-lax: true/false, 0/1, "true"/"yes"/"on"/..."""
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise bad_request(f"{key} must be a boolean", key)


def validate_cache_salt(value: Any) -> str | None:
    """vLLM's rule: absent/null, or a non-empty string of at most 128 characters containing
    none of ``@``, ``/``, ``\\``, NUL. Otherwise a 400 with ``param: "cache_salt"``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(value) > 128 or not _SALT_FORBIDDEN.isdisjoint(value):
        raise bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\', or NUL.",
            "cache_salt",
        )
    return value


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if opts and not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = bool(opts and _opt_bool(opts, "include_usage"))
    return stream, include_usage


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return (
            isinstance(x, list)
            and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if is_ids(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(is_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    if prompt is None or prompt == [] or prompt == "":
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    raise bad_request(
        "prompt must be a non-empty string, a list of token ids, a list of "
        "strings or a list of lists of token ids",
        "prompt",
    )


def _usage(
    prompt_tokens: int, completion_tokens: int, cached: int, details: bool, zero: bool = False
) -> dict[str, Any]:
    # vLLM 0.34 attaches prompt_tokens_details whenever --enable-prompt-tokens-details is on
    # (chat_completion/serving.py:_make_prompt_tokens_details: num_cached_tokens is an int, 0
    # on a miss). Older releases attached it only on a hit (`... and num_cached_tokens`);
    # ``zero=False`` reproduces that: `"prompt_tokens_details": null` on a miss.
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": (
            {"cached_tokens": cached} if details and (cached or zero) else None
        ),
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_dumps(obj).encode(), status=status, content_type="application/json", headers=headers
    )


# ---------------------------------------------------------------------- the replica


class SimReplica:
    """One simulated vLLM server. ``await start()``, then talk HTTP to ``url``.

    For tests: ``stats`` is a live dict — ``requests`` (generation requests that reached the
    engine), ``queries`` / ``hits`` (prompt / cached tokens, as vLLM's prefix-cache counters),
    ``prompt_tokens``, ``generation_tokens``, ``finished``, ``aborted``,
    ``injected_failures``, ``errors`` (4xx/5xx answered) and ``records``, one dict per
    finished or aborted engine request (request_id, endpoint, model, lora, cache_salt,
    prompt_tokens, cached_tokens, completion_tokens, finish_reason, arrival, queue_s, ttft_s,
    e2e_s; times are the simulation's). ``engine`` exposes the scheduler and block pool.
    ``fail_next`` / ``health_status`` inject faults; ``wait_idle`` / ``wait_for`` wait for
    engine states without sleeping.
    """

    def __init__(self, config: SimConfig | None = None, renderer: Renderer | None = None) -> None:
        self.config = config or SimConfig()
        self._renderer = renderer
        self._words: _Words | None = None
        self.stats: dict[str, Any] = new_stats()
        self.health_status = 200
        self.url = ""
        self.host: str | None = None
        self.port: int | None = None
        self._fail_remaining = 0
        self._fail_status = 503
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._created = int(time.time())
        self._streams = 0
        self._started_once = False
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
            request_overhead_s=c.request_overhead_s,
            max_num_seqs=c.max_num_seqs,
            instant=c.instant,
            metrics=self.metrics,
            stats=self.stats,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = get_renderer(self.config.tokenizer)
        return self._renderer

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0 = any free port); returns the base URL. A replica that
        was stopped starts again empty, like a restarted process."""
        if self._runner is not None:
            raise RuntimeError("replica already started")
        if self._renderer is None:
            self._renderer = await asyncio.to_thread(get_renderer, self.config.tokenizer)
        if self._words is None:
            self._words = await asyncio.to_thread(_get_words, self._renderer)
        if self._started_once:
            self._new_engine()
        self._started_once = True
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
        self.host = host
        self.port = int(runner.addresses[0][1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Close the listening socket and abort every open connection (like a killed
        process); in-flight requests are aborted and their blocks freed."""
        runner, site = self._runner, self._site
        if runner is None:
            return
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
        await asyncio.sleep(0)  # let connection_lost cancel the handlers
        with contextlib.suppress(Exception):
            await runner.cleanup()

    # ------------------------------------------------------------------ test hooks

    def fail_next(self, n: int, status: int = 503) -> None:
        """The next ``n`` generation requests answer ``status`` before any byte."""
        self._fail_remaining = max(0, int(n))
        self._fail_status = int(status)

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
        app = web.Application(client_max_size=256 * 2**20, middlewares=[self._middleware])
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_get("/v1/models", self._models)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_get("/health", self._health)
        r.add_get("/version", self._version)
        r.add_get("/metrics", self._metrics)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        return app

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
            return _json_response({"detail": e.reason}, e.status, headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # never let a bug take the replica down
            log.exception("internal error on %s %s", request.method, request.path)
            self.stats["errors"] += 1
            return APIError(500, f"Internal server error: {type(e).__name__}: {e}").response()

    # ------------------------------------------------------------------ helpers

    async def _read_json(self, request: web.Request) -> tuple[dict[str, Any], int]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"Invalid JSON in request body: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("Request body must be a JSON object")
        return body, len(raw)

    def _resolve_model(self, body: dict[str, Any]) -> tuple[str, str | None]:
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

    def _maybe_fail(self) -> None:
        if self._fail_remaining > 0:
            self._fail_remaining -= 1
            self.stats["injected_failures"] += 1
            raise APIError(
                self._fail_status, f"Simulated failure (fail_next), status {self._fail_status}"
            )

    @staticmethod
    async def _offload(fn: Callable[[], _T], heavy: bool) -> _T:
        return await asyncio.to_thread(fn) if heavy else fn()

    def _render_chat(self, body: dict[str, Any]) -> list[int]:
        try:
            ids = self.renderer.tokenize_chat(body)
        except APIError:
            raise
        except Exception as e:  # template or content errors are the client's
            raise bad_request(
                f"Could not render the chat request: {type(e).__name__}: {e}", "messages"
            ) from None
        return list(ids)

    def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                return list(self.renderer.tokenize_completion(prompt))
            except APIError:
                raise
            except Exception as e:
                raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None
        self._check_ids(prompt, "prompt")
        return list(prompt)

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        words = self._words or _get_words(self.renderer)
        bad = [t for t in ids if t < 0 or t > words.max_token_id]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary", param)

    def _max_tokens(self, requested: int | None, p: int) -> int:
        c = self.config
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
        need = self.engine.blocks_needed(p, m)
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
    ) -> Seq:
        words = self._words or _get_words(self.renderer)
        out = words.sample(self.config.seed, ids, max_tokens)
        return Seq(request_id, ids, out, hashes, lora=lora, cache_salt=salt, meta=meta)

    def _text(self, ids: Sequence[int]) -> str:
        words = self._words or _get_words(self.renderer)
        return "".join(words.text[t] for t in ids)

    def _request_id(self, request: web.Request) -> str:
        rid = request.headers.get("X-Request-Id")
        return rid if rid else uuid.uuid4().hex

    # ------------------------------------------------------------------ generation

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._maybe_fail()
        body, size = await self._read_json(request)
        model, lora = self._resolve_model(body)
        salt = validate_cache_salt(body.get("cache_salt"))
        stream, include_usage = _stream_options(body)
        mct = _opt_int(body, "max_completion_tokens", 1)
        mt = _opt_int(body, "max_tokens", 1)
        _opt_int(body, "n", 1)
        bs = self.config.block_size

        def prepare() -> tuple[list[int], list[bytes]]:
            ids = self._render_chat(body)
            return ids, block_hashes(ids, bs, lora=lora, cache_salt=salt)

        ids, hashes = await self._offload(prepare, size > _OFFLOAD_BYTES)
        max_tokens = self._max_tokens(mct or mt, len(ids))
        base = self._request_id(request)
        rid = f"chatcmpl-{base}"
        seq = self._make_seq(
            rid, ids, hashes, max_tokens, lora, salt, {"endpoint": "chat", "model": model}
        )
        return await self._generate(request, "chat", rid, base, model, [seq], stream, include_usage)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self._maybe_fail()
        body, size = await self._read_json(request)
        model, lora = self._resolve_model(body)
        salt = validate_cache_salt(body.get("cache_salt"))
        stream, include_usage = _stream_options(body)
        mt = _opt_int(body, "max_tokens", 1)
        _opt_int(body, "n", 1)
        bs = self.config.block_size
        by_request = getattr(self.renderer, "tokenize_completion_request", None)
        if by_request is None:  # an older Renderer: parse the prompt forms here
            if body.get("suffix"):
                raise bad_request("suffix is not supported", "suffix")
            prompts = _completion_prompts(body.get("prompt"))
        prompt = body.get("prompt")
        n_tokens_hint = len(prompt) if isinstance(prompt, list) else 0

        def prepare() -> list[tuple[list[int], list[bytes]]]:
            try:
                if by_request is not None:
                    all_ids = [list(ids) for ids in by_request(body)]
                else:
                    all_ids = [self._tokenize_prompt(p) for p in prompts]
            except APIError:
                raise
            except Exception as e:
                raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None
            return [(ids, block_hashes(ids, bs, lora=lora, cache_salt=salt)) for ids in all_ids]

        heavy = size > _OFFLOAD_BYTES or n_tokens_hint > _OFFLOAD_TOKENS
        prepared = await self._offload(prepare, heavy)
        base = self._request_id(request)
        rid = f"cmpl-{base}"
        seqs = []
        for i, (ids, hashes) in enumerate(prepared):
            m = self._max_tokens(mt, len(ids))
            sid = rid if len(prepared) == 1 else f"{rid}-{i}"
            seqs.append(
                self._make_seq(
                    sid, ids, hashes, m, lora, salt, {"endpoint": "completions", "model": model}
                )
            )
        return await self._generate(
            request, "completions", rid, base, model, seqs, stream, include_usage
        )

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
    ) -> web.StreamResponse:
        headers = {"X-Request-Id": base_id}
        engine = self.engine
        engine.submit(seqs)
        try:
            if stream:
                return await self._stream(request, kind, rid, model, seqs, include_usage, headers)
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
        details = self.config.enable_prompt_tokens_details
        p = sum(s.num_prompt_tokens for s in seqs)
        c = sum(s.max_tokens for s in seqs)
        cached = sum(s.num_cached_tokens for s in seqs)
        usage = _usage(p, c, cached, details, self.config.always_report_cached_tokens)
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
                "kv_transfer_params": None,
            }
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
                "kv_transfer_params": None,
            }
        return _json_response(resp, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        model: str,
        seqs: list[Seq],
        include_usage: bool,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                **headers,
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            },
        )
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = (
            f'data: {{"id":{_dumps(rid)},"object":"{obj}","created":{created},'
            f'"model":{_dumps(model)},"choices":[{{"index":'
        )
        words = self._words or _get_words(self.renderer)
        text = words.text
        engine = self.engine
        dt = engine.dt
        loop = asyncio.get_running_loop()
        n = len(seqs)
        emitted = [0] * n
        self._streams += 1
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
                    for k in range(emitted[i], due):
                        piece = _dumps(text[s.output_ids[k]])
                        if kind == "chat":
                            if k == 0:
                                parts.append(
                                    f'{head}{i},"delta":{{"role":"assistant",'
                                    f'"content":""}},"logprobs":null,'
                                    f'"finish_reason":null}}]}}\n\n'
                                )
                            tail = (
                                '"finish_reason":"length","stop_reason":null'
                                if k == m - 1
                                else '"finish_reason":null'
                            )
                            parts.append(
                                f'{head}{i},"delta":{{"content":{piece}}},'
                                f'"logprobs":null,{tail}}}]}}\n\n'
                            )
                        else:
                            fin = '"length"' if k == m - 1 else "null"
                            parts.append(
                                f'{head}{i},"text":{piece},"logprobs":null,'
                                f'"finish_reason":{fin},"stop_reason":null}}]}}\n\n'
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
                    delay = max(delay, self._tick())
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
                usage = _usage(
                    sum(s.num_prompt_tokens for s in seqs),
                    sum(s.max_tokens for s in seqs),
                    sum(s.num_cached_tokens for s in seqs),
                    self.config.enable_prompt_tokens_details,
                    self.config.always_report_cached_tokens,
                )
                if usage["prompt_tokens_details"] is None:
                    del usage["prompt_tokens_details"]  # unset fields are omitted in streams
                tail_parts.append(
                    "data: "
                    + _dumps(
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
            self._streams -= 1
        return resp

    def _tick(self) -> float:
        """Minimum gap between two writes of one stream after its first token: output that
        falls due in between is written together (still one SSE event per token). Grows with
        the number of open streams so a busy process stays cheap."""
        if self.config.instant:
            return 0.0
        return min(0.05, max(0.001, 0.001 * self._streams / 8))

    # ------------------------------------------------------------------ other endpoints

    async def _tokenize(self, request: web.Request) -> web.Response:
        body, size = await self._read_json(request)
        self._resolve_model(body)
        want_strs = bool(_opt_bool(body, "return_token_strs"))
        if "messages" in body:
            ids = await self._offload(lambda: self._render_chat(body), size > _OFFLOAD_BYTES)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string (or send messages)", "prompt")
            add_special = _opt_bool(body, "add_special_tokens")
            add_special = True if add_special is None else add_special

            def encode() -> list[int]:
                by_request = getattr(self.renderer, "tokenize_completion_request", None)
                try:
                    if by_request is not None:
                        return list(
                            by_request({"prompt": prompt, "add_special_tokens": add_special})[0]
                        )
                    if add_special:
                        return self._tokenize_prompt(prompt)
                    return list(self.renderer.tokenizer.encode(prompt, add_special_tokens=False))
                except APIError:
                    raise
                except Exception as e:
                    raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None

            ids = await self._offload(encode, size > _OFFLOAD_BYTES)
        strs = self.renderer.tokenizer.convert_ids_to_tokens(ids) if want_strs else None
        return _json_response(
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        body, _ = await self._read_json(request)
        self._resolve_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("tokens must be a list of token ids", "tokens")
        self._check_ids(tokens, "tokens")
        return _json_response({"prompt": self.renderer.decode(tokens)})

    async def _models(self, request: web.Request) -> web.Response:
        c = self.config

        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict:
            return {
                "id": mid,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_DNS, mid).hex}",
                        "object": "model_permission",
                        "created": self._created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        data = [card(c.model, c.model, None, c.max_model_len)]
        data += [card(name, f"/adapters/{name}", c.model, None) for name in c.lora_adapters]
        return _json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _version(self, request: web.Request) -> web.Response:
        return _json_response({"version": VLLM_VERSION})

    async def _metrics(self, request: web.Request) -> web.Response:
        running, waiting = self.engine.counts()
        m = self.metrics
        m.running.set(running)
        m.waiting.set(waiting)
        m.kv_usage.set(self.engine.pool.usage())
        return web.Response(
            body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.reset_cache()
        return web.Response(status=200)


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
        renderer = await asyncio.to_thread(get_renderer, cfg.tokenizer)
    await asyncio.to_thread(_get_words, renderer)
    replicas = [SimReplica(cfg, renderer) for _ in range(n)]
    try:
        for r in replicas:
            await r.start()
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


# ---------------------------------------------------------------------- CLI


def build_parser(prog: str = "python -m loadtest.replica") -> argparse.ArgumentParser:
    d = SimConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run simulated vLLM replicas: vLLM's OpenAI-compatible API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /tokenize, "
        "/detokenize, /health, /version, /metrics) with vLLM's prefix cache and a "
        "prefill/decode timing model, no GPU. Prints 'ready http://HOST:PORT' per "
        "replica once listening; stops on SIGINT/SIGTERM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=9001,
        help="port of the first replica (0: any free port for each)",
    )
    p.add_argument(
        "--count", type=int, default=1, help="number of replicas, on consecutive ports from --port"
    )
    p.add_argument("--model", default=d["model"].default, help="served model name")
    p.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer directory or Hugging Face name"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d["block_size"].default,
        help="tokens per KV block (the prefix-cache granularity)",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d["num_gpu_blocks"].default,
        help="KV blocks in the pool; free cached blocks are evicted LRU",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d["prefill_tokens_per_s"].default,
        help="uncached prompt tokens processed per second (one FIFO per replica)",
    )
    p.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=d["decode_tokens_per_s"].default,
        help="output tokens per second of each running request",
    )
    p.add_argument(
        "--request-overhead-s",
        type=float,
        default=d["request_overhead_s"].default,
        help="fixed time per request before its first token",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=d["max_tokens_default"].default,
        help="output tokens when a request sets no max_tokens",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d["max_num_seqs"].default,
        help="most requests admitted at once; the rest wait",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"].default,
        help="context length (prompt + output)",
    )
    p.add_argument(
        "--lora",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapter names served besides the base model",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument(
        "--always-report-cached-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send prompt_tokens_details {cached_tokens: 0} on a miss, as vLLM 0.34 does "
        "(--no-always-report-cached-tokens: null on a miss, as older releases)",
    )
    p.add_argument(
        "--instant", action="store_true", help="no simulated time at all: answer immediately"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tokens")
    p.add_argument("--log-level", default="WARNING", help="logging level")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        request_overhead_s=args.request_overhead_s,
        max_tokens_default=args.max_tokens_default,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        lora_adapters=list(args.lora),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        always_report_cached_tokens=args.always_report_cached_tokens,
        instant=args.instant,
        seed=args.seed,
    )


async def _serve(cfg: SimConfig, host: str, port: int, count: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    renderer = await asyncio.to_thread(get_renderer, cfg.tokenizer)
    await asyncio.to_thread(_get_words, renderer)
    replicas: list[SimReplica] = []
    try:
        for i in range(count):
            r = SimReplica(cfg, renderer)
            try:
                await r.start(host, port + i if port else 0)
            except OSError as e:
                print(
                    f"error: cannot listen on {host}:{port + i if port else 0}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            replicas.append(r)
            print(f"ready {r.url}", flush=True)
        await stop.wait()
        return 0
    finally:
        for r in replicas:
            await r.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.count < 1:
        print("error: --count must be at least 1", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(cfg, args.host, args.port, args.count))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
