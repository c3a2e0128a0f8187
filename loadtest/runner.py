"""Drive a workload against a target and collect per-request records and replica counters.

``await run_workload(target, workload, ...)`` is the one entry point (the CLI, the comparison
mode and ``prefix-router demo`` all call it). A *target* is where requests go:

- :class:`GatewayTarget`: a prefix-router (or any OpenAI-compatible gateway) URL; the replica
  that served a request is read from the ``x-prefix-router-replica`` response header.
- :class:`ClientTarget`: a list of replica URLs with a client-side baseline policy
  (``round_robin`` or ``random``), for comparing the gateway against the simplest routers.

Either way the replicas' ``/metrics`` URLs must be known: the fleet hit rate is read from their
own counters (deltas over the run), never from what the client or the gateway believes.

Bounds: at most ``concurrency`` requests in flight, at most ``max_requests`` sent, no request
started after ``max_seconds``, each request limited to ``request_timeout_s``; in-flight requests
are drained after the deadline, and anything still running ``request_timeout_s + 5`` s after it
is cancelled (and counted as lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from loadtest import metrics_scrape as ms
from loadtest.ideal import IdealRequest, IdealResult, ideal_hit_rate
from loadtest.sim.tokens import get_renderer
from loadtest.workloads import RequestSpec, Session, Workload
from router.core.bundled import tokenizer_dir

REPLICA_HEADER = "x-prefix-router-replica"
CACHED_BLOCKS_HEADER = "x-prefix-router-cached-blocks"
QUEUED_HEADER = "x-prefix-router-queued-ms"  # flow control: how long it waited in the gateway
PREFILL_HEADER = "x-prefix-router-prefill-replica"  # P/D: the replica that ran its prefill leg
CLIENT_POLICIES = ("round_robin", "random")
try:  # the gateway's registry, ttft first; without the gateway, client-side baselines only
    from router.schedule import policy_names

    GATEWAY_POLICIES: tuple[str, ...] = tuple(policy_names())
except ImportError:
    GATEWAY_POLICIES = ()


def bundled_tokenizer_dir() -> Path:
    return tokenizer_dir()


def default_renderer(path: str | Path | None = None) -> Any:
    """``router.prompt.Renderer`` for the bundled Qwen3 tokenizer, on its plain whole-prompt
    path (``tokenize_chat`` renders exactly as vLLM); the one the simulated replicas in this
    process share (loading one costs seconds)."""
    return get_renderer(str(path or bundled_tokenizer_dir()))


_IDEAL_RENDERERS: dict[str, Any] = {}


def ideal_renderer(path: str | Path | None = None) -> Any:
    """The renderer the ideal replays prompts with: ``router.prompt.Renderer`` with its segment
    cache and prefix states, whose ids are the whole-prompt path's (the gateway's own
    token-exactness; tests/test_agentic.py checks it on agent sessions) for a fraction of the
    work on a growing conversation: 60 agent prompts growing to 103k tokens took 12.6 s on the
    plain path, 0.3 s on this one."""
    key = str(path or bundled_tokenizer_dir())
    r = _IDEAL_RENDERERS.get(key)
    if r is None:
        from loadtest.sim.vllm_chat import load_tokenizer
        from router.prompt.renderer import Renderer

        r = _IDEAL_RENDERERS[key] = Renderer(load_tokenizer(key))
    return r


# ---------------------------------------------------------------------------------------------
# targets


def _norm(url: str) -> str:
    return url.rstrip("/")


class Target:
    """Where requests go, and which replicas' /metrics to read."""

    kind = "target"
    policy = ""

    def __init__(self, name: str, replica_urls: list[str]) -> None:
        self.name = name
        self.replica_urls = [_norm(u) for u in replica_urls]

    def choose(self, spec: RequestSpec) -> str:
        raise NotImplementedError

    def served_by(self, chosen: str, headers: Any) -> str | None:
        return chosen

    def describe(self) -> str:
        return self.name


class GatewayTarget(Target):
    """A gateway URL. ``replica_urls`` are the replicas it fronts (for their /metrics)."""

    kind = "gateway"

    def __init__(
        self, url: str, replica_urls: list[str], *, name: str | None = None, policy: str = "gateway"
    ) -> None:
        super().__init__(name or policy, replica_urls)
        self.url = _norm(url)
        self.policy = policy

    def choose(self, spec: RequestSpec) -> str:
        return self.url

    def served_by(self, chosen: str, headers: Any) -> str | None:
        v = headers.get(REPLICA_HEADER) if headers is not None else None
        return _norm(v) if v else None

    def describe(self) -> str:
        return f"gateway {self.url} (policy {self.policy})"


class ClientTarget(Target):
    """Replicas addressed directly with a client-side policy: ``round_robin`` (in send order)
    or ``random`` (seeded)."""

    kind = "client"

    def __init__(
        self,
        replica_urls: list[str],
        policy: str = "round_robin",
        *,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        if policy not in CLIENT_POLICIES:
            raise ValueError(f"client-side policy must be one of {CLIENT_POLICIES}")
        if not replica_urls:
            raise ValueError("a client-side target needs at least one replica URL")
        super().__init__(name or policy, replica_urls)
        self.policy = policy
        self._rng = random.Random(f"{seed}:client:{policy}")
        self._next = 0

    def choose(self, spec: RequestSpec) -> str:
        if self.policy == "random":
            return self._rng.choice(self.replica_urls)
        url = self.replica_urls[self._next % len(self.replica_urls)]
        self._next += 1
        return url

    def describe(self) -> str:
        return f"{len(self.replica_urls)} replicas, client-side {self.policy}"


class GatewayUnavailable(RuntimeError):
    pass


async def _start_gateway(
    policy: str, replica_urls: list[str], *, seed: int = 0, **overrides: Any
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Start a fresh in-process gateway (``router.http.app.start_gateway``) with ``policy`` in front
    of ``replica_urls`` on a free loopback port; return its URL and an async stop function.
    ``overrides`` are further ``router.config.Config`` fields."""
    try:
        from router.config import load_config
        from router.http.app import start_gateway
        from router.ops.admin import SERVED_EXTENSIONS
    except ImportError as e:  # pragma: no cover - the gateway ships in this distribution
        raise GatewayUnavailable(f"the in-process gateway is not available ({e})") from e
    config = load_config(
        None,
        env={},
        replicas=list(replica_urls),
        policy=policy,
        host="127.0.0.1",
        tokenizer=str(bundled_tokenizer_dir()),
        **overrides,
    )
    running = await start_gateway(config, port=0, extensions=SERVED_EXTENSIONS)
    return running.url, running.stop


async def _noop() -> None:
    return None


async def start_target(
    policy: str, replica_urls: list[str], *, seed: int = 0, **gateway_overrides: Any
) -> tuple[Target, Callable[[], Awaitable[None]]]:
    """A fresh target for ``policy`` in front of ``replica_urls`` and its async stop function.

    ``client:round_robin`` / ``client:random`` are the client-side baselines (no gateway). Other
    names are gateway policies (``GATEWAY_POLICIES``, from the gateway's registry), each run
    by a fresh in-process gateway; should none be importable,
    ``round_robin`` and ``random`` fall back to the client-side baselines (labelled so)."""
    if policy.startswith("client:"):
        p = policy.split(":", 1)[1]
        return ClientTarget(replica_urls, p, seed=seed, name=f"{p} (client)"), _noop
    try:
        url, stop = await _start_gateway(policy, replica_urls, seed=seed, **gateway_overrides)
    except GatewayUnavailable:
        if policy in CLIENT_POLICIES:
            return ClientTarget(replica_urls, policy, seed=seed, name=f"{policy} (client)"), _noop
        raise
    return GatewayTarget(url, replica_urls, policy=policy, name=policy), stop


# ---------------------------------------------------------------------------------------------
# records and results


@dataclass
class RequestRecord:
    """One request. Times are seconds from the start of the run; ``status`` is None when no
    HTTP response arrived (connection error, timeout, cancelled): such a request is lost."""

    index: int
    session: str
    group: str
    turn: int
    endpoint: str
    scheduled_s: float
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    error: str | None = None
    target: str = ""
    replica: str | None = None
    predicted_cached_blocks: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    output_chars: int = 0
    harness_prompt_tokens: int | None = None
    ideal_cached_tokens: int | None = None
    queued_ms: float | None = None  # waited in the gateway's flow-control queue
    prefill_replica: str | None = None  # P/D: its prefill leg's replica (None: no prefill leg)
    # in memory only (not written to requests.jsonl)
    spec: RequestSpec | None = field(default=None, repr=False)
    answer: str | None = field(default=None, repr=False)

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None or self.sent_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def latency_s(self) -> float | None:
        if self.end_s is None or self.sent_s is None or self.status is None:
            return None
        return self.end_s - self.sent_s

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("spec", None)
        d.pop("answer", None)
        d["ttft_s"] = self.ttft_s
        d["latency_s"] = self.latency_s
        return d


def percentiles(values: list[float], ps: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}
    out["mean"] = float(arr.mean())
    return out


@dataclass
class ReplicaRow:
    url: str
    requests: int
    hit_rate: float | None
    hits: float
    queries: float
    prompt_tokens: float
    prefilled_tokens: float
    metrics_ok: bool


@dataclass
class RunResult:
    """Everything one run produced. ``records`` are in send order (unsent ones last)."""

    label: str
    workload: str
    workload_description: str
    workload_params: dict[str, Any]
    target: str
    policy: str
    seed: int
    concurrency: int
    max_requests: int | None
    max_seconds: float
    stream: bool
    started_at: str
    duration_s: float
    records: list[RequestRecord]
    replica_deltas: list[ms.ReplicaDelta]
    block_size: int
    ideal: IdealResult | None = None
    warnings: list[str] = field(default_factory=list)
    # Why sending stopped: "max_requests", "max_seconds", or "workload" (all it planned sent).
    stop_reason: str = "workload"
    planned_requests: int = 0
    # A gateway target's own counters over the run: "decisions:<reason>", "spills:<cause>".
    gateway_counters: dict[str, float] = field(default_factory=dict)
    # CPU time of this process while it sent: the load generator's, and that of any simulated
    # replicas it runs in-process (``loadtest run --simulate``)
    client_cpu_s: float = 0.0

    # ---- derived figures
    def stop_description(self) -> str:
        """Why the run sent what it sent, in words (the demo and the report print it)."""
        if self.stop_reason == "max_requests":
            return f"reached --max-requests ({self.max_requests})"
        if self.stop_reason == "max_seconds":
            return (
                f"reached the {self.max_seconds:g} s limit; {self.planned_requests - self.sent} "
                "planned requests not sent"
            )
        return f"the workload ended: every one of its {self.planned_requests} requests was sent"

    def replica_sets(self) -> dict[str, Counter[str]]:
        """Each prefix group's requests by the replica that served them."""
        out: dict[str, Counter[str]] = {}
        for r in self.records:
            if r.replica is not None and r.sent_s is not None:
                out.setdefault(r.group, Counter())[r.replica] += 1
        return out

    @property
    def sent(self) -> int:
        return sum(1 for r in self.records if r.sent_s is not None)

    @property
    def responded(self) -> int:
        return sum(1 for r in self.records if r.sent_s is not None and r.status is not None)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.records if r.ok)

    @property
    def lost(self) -> int:
        """Requests sent that never got any HTTP response. Must be 0."""
        return self.sent - self.responded

    @property
    def errors_by_status(self) -> dict[str, int]:
        c: Counter[str] = Counter()
        for r in self.records:
            if r.sent_s is None or r.ok:
                continue
            c[
                str(r.status) if r.status is not None else (r.error or "no response").split(":")[0]
            ] += 1
        return dict(sorted(c.items()))

    @property
    def failed(self) -> list[RequestRecord]:
        """Sent requests that did not complete: a 4xx/5xx, a broken stream or no response.
        No workload asks for failures, so each one is a finding."""
        return [r for r in self.records if r.sent_s is not None and not r.ok]

    @property
    def fleet_hit_rate(self) -> float | None:
        return ms.fleet_hit_rate(self.replica_deltas)

    @property
    def ideal_hit_rate(self) -> float | None:
        return self.ideal.hit_rate if self.ideal else None

    @property
    def hit_ratio(self) -> float | None:
        f, i = self.fleet_hit_rate, self.ideal_hit_rate
        return f / i if f is not None and i else None

    @property
    def client_hit_rate(self) -> float | None:
        """sum(usage cached_tokens) / sum(usage prompt_tokens) over responses reporting both."""
        rs = [r for r in self.records if r.ok and r.cached_tokens is not None and r.prompt_tokens]
        q = sum(r.prompt_tokens or 0 for r in rs)
        return sum(r.cached_tokens or 0 for r in rs) / q if q else None

    @property
    def ttft(self) -> dict[str, float]:
        return percentiles([r.ttft_s for r in self.records if r.ok and r.ttft_s is not None])

    @property
    def latency(self) -> dict[str, float]:
        return percentiles([r.latency_s for r in self.records if r.ok and r.latency_s is not None])

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    def replica_rows(self) -> list[ReplicaRow]:
        counts = Counter(
            _norm(r.replica) for r in self.records if r.replica and r.sent_s is not None
        )
        rows = []
        seen = set()
        for d in self.replica_deltas:
            u = _norm(ms.base_url(d.url))
            seen.add(u)
            rows.append(
                ReplicaRow(
                    u,
                    counts.get(u, 0),
                    d.hit_rate,
                    d.hits,
                    d.queries,
                    d.prompt_tokens,
                    d.prefilled_tokens,
                    d.ok,
                )
            )
        for u, n in sorted(counts.items()):
            if u not in seen:
                rows.append(ReplicaRow(u, n, None, 0.0, 0.0, 0.0, 0.0, False))
        return rows

    def balance(self) -> dict[str, float | None]:
        """max/mean across replicas of requests served and of prefilled tokens (1.0 = even)."""
        rows = [r for r in self.replica_rows() if r.metrics_ok or r.requests]

        def mm(vals: list[float]) -> float | None:
            m = float(np.mean(vals)) if vals else 0.0
            return max(vals) / m if m > 0 else None

        return {
            "requests_max_over_mean": mm([float(r.requests) for r in rows]),
            "prefill_max_over_mean": mm([r.prefilled_tokens for r in rows if r.metrics_ok]),
        }

    def summary(self) -> dict[str, Any]:
        b = self.balance()
        return {
            "label": self.label,
            "workload": self.workload,
            "target": self.target,
            "policy": self.policy,
            "seed": self.seed,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "client_cpu_s": round(self.client_cpu_s, 3),
            "sent": self.sent,
            "responded": self.responded,
            "ok": self.ok,
            "lost": self.lost,
            "errors_by_status": self.errors_by_status,
            "fleet_hit_rate": self.fleet_hit_rate,
            "ideal_hit_rate": self.ideal_hit_rate,
            "hit_ratio": self.hit_ratio,
            "client_reported_hit_rate": self.client_hit_rate,
            "ttft_s": self.ttft,
            "latency_s": self.latency,
            "throughput_rps": self.throughput_rps,
            "block_size": self.block_size,
            **b,
            "replicas": [asdict(r) for r in self.replica_rows()],
            "workload_params": self.workload_params,
            "warnings": self.warnings,
            "concurrency": self.concurrency,
            "max_requests": self.max_requests,
            "max_seconds": self.max_seconds,
            "stream": self.stream,
            "stop_reason": self.stop_reason,
            "planned_requests": self.planned_requests,
            "gateway_counters": self.gateway_counters,
            "replica_set_sizes": dict(
                sorted(Counter(len(c) for c in self.replica_sets().values()).items())
            ),
        }


# ---------------------------------------------------------------------------------------------
# one HTTP request


def _error_message(text: str) -> str:
    try:
        d = json.loads(text)
        if isinstance(d, dict):
            e = d.get("error", d)
            if isinstance(e, dict) and e.get("message"):
                return str(e["message"])[:300]
            if isinstance(d.get("message"), str):
                return d["message"][:300]
    except ValueError:
        pass
    return text[:300]


def _apply_usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if not isinstance(usage, dict):
        return
    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
    rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _piece(endpoint: str, choice: dict[str, Any], stream: bool) -> str:
    if endpoint == "chat":
        msg = choice.get("delta" if stream else "message") or {}
        return msg.get("content") or ""
    return choice.get("text") or ""


def _read_headers(rec: RequestRecord, headers: Any) -> None:
    """What the gateway says of a request in its response headers."""
    hdr = headers.get(CACHED_BLOCKS_HEADER)
    if hdr is not None:
        with contextlib.suppress(ValueError):
            rec.predicted_cached_blocks = int(hdr)
    rec.prefill_replica = headers.get(PREFILL_HEADER)
    if (queued := headers.get(QUEUED_HEADER)) is not None:
        with contextlib.suppress(ValueError):
            rec.queued_ms = float(queued)


class MessagesClients:
    """Anthropic SDK clients, one per base URL, for the requests that speak Messages: the
    SDK's own HTTP client, retries off (a load generator counts failures, it does not hide
    them)."""

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}

    def get(self, url: str) -> Any:
        client = self._clients.get(url)
        if client is None:
            import anthropic  # the loadtest extra's; only a run with Messages sessions needs it

            client = self._clients[url] = anthropic.AsyncAnthropic(
                base_url=url, api_key="unused", max_retries=0
            )
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


def _apply_messages_usage(rec: RequestRecord, usage: Any) -> None:
    """Anthropic's usage: ``input_tokens`` leaves out the cache read (vLLM's too)."""
    if usage is None:
        return
    cached = getattr(usage, "cache_read_input_tokens", None)
    if getattr(usage, "input_tokens", None) is not None:
        rec.prompt_tokens = usage.input_tokens + (cached or 0)
    if cached is not None:
        rec.cached_tokens = int(cached)
    if getattr(usage, "output_tokens", None):
        rec.completion_tokens = usage.output_tokens


def _sdk_kwargs(call: Any, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as keyword arguments of the SDK's ``call``: the fields it does not name (an SDK
    release may drop one, as 2.x's ``stream`` did ``temperature``) go as ``extra_body``."""
    named = inspect.signature(call).parameters
    kwargs = {k: v for k, v in body.items() if k in named}
    rest = {k: v for k, v in body.items() if k not in named}
    if rest:
        kwargs["extra_body"] = rest
    return kwargs


async def _do_messages(
    clients: MessagesClients,
    url: str,
    rec: RequestRecord,
    body: dict[str, Any],
    *,
    stream: bool,
    timeout_s: float,
    t0: float,
) -> Any | None:
    """``_do_request`` for a Messages request, through Anthropic's SDK as its users send it:
    streamed with ``messages.stream`` (the first text delta is the first token)."""
    import anthropic

    client = clients.get(url)
    extra = dict(rec.spec.headers) if rec.spec else {}
    call = client.messages.stream if stream else client.messages.with_raw_response.create
    kwargs = _sdk_kwargs(call, body)
    now = time.perf_counter
    rec.sent_s = now() - t0
    headers = None
    try:
        if stream:
            async with call(**kwargs, extra_headers=extra, timeout=timeout_s) as events:
                rec.status = events.response.status_code
                headers = events.response.headers
                _read_headers(rec, headers)
                async for text in events.text_stream:
                    if text and rec.first_token_s is None:
                        rec.first_token_s = now() - t0
                final = await events.get_final_message()
        else:
            raw = await call(**kwargs, extra_headers=extra, timeout=timeout_s)
            rec.status, headers = raw.status_code, raw.headers
            _read_headers(rec, headers)
            final = raw.parse()
            if inspect.isawaitable(final):  # the async client's raw response parses async
                final = await final
        rec.end_s = now() - t0
        _apply_messages_usage(rec, final.usage)
        rec.answer = "".join(b.text for b in final.content if getattr(b, "type", "") == "text")
        rec.output_chars = len(rec.answer)
    except anthropic.APIStatusError as e:
        rec.status, headers = e.status_code, e.response.headers
        _read_headers(rec, headers)
        rec.error = _error_message(e.response.text)
        rec.end_s = now() - t0
    except anthropic.APITimeoutError:
        rec.error = f"timeout: no complete response within {timeout_s} s"
        rec.end_s = now() - t0
    except anthropic.APIConnectionError as e:
        rec.error = f"{type(e).__name__}: {e}"
        rec.end_s = now() - t0
    except anthropic.APIError as e:  # an error event inside a stream
        rec.error = str(e)
        rec.end_s = now() - t0
    return headers


async def _do_request(
    http: aiohttp.ClientSession,
    url: str,
    rec: RequestRecord,
    body: dict[str, Any],
    *,
    stream: bool,
    timeout_s: float,
    t0: float,
) -> Any | None:
    """Send one request, fill ``rec``; return the response headers (None if no response)."""
    path = "/v1/chat/completions" if rec.endpoint == "chat" else "/v1/completions"
    payload = dict(body)
    if stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    else:
        payload["stream"] = False
    data = json.dumps(payload, separators=(",", ":")).encode()
    now = time.perf_counter
    rec.sent_s = now() - t0
    pieces: list[str] = []
    headers = None
    try:
        async with http.post(
            url + path,
            data=data,
            headers={"content-type": "application/json", **(rec.spec.headers if rec.spec else {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            rec.status = resp.status
            headers = resp.headers
            _read_headers(rec, headers)
            if resp.status != 200:
                rec.error = _error_message(await resp.text())
            elif not stream:
                d = await resp.json(content_type=None)
                for ch in d.get("choices") or []:
                    pieces.append(_piece(rec.endpoint, ch, False))
                rec.first_token_s = None
                _apply_usage(rec, d.get("usage"))
            else:
                first_choice_s = None
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    chunk = line[5:].strip()
                    if chunk == b"[DONE]":
                        break
                    try:
                        d = json.loads(chunk)
                    except ValueError:
                        continue
                    if "error" in d and not d.get("choices"):
                        err = d["error"]
                        rec.error = str(err.get("message") if isinstance(err, dict) else err)
                        continue
                    for ch in d.get("choices") or []:
                        if first_choice_s is None:
                            first_choice_s = now() - t0
                        p = _piece(rec.endpoint, ch, True)
                        if p:
                            if rec.first_token_s is None:
                                rec.first_token_s = now() - t0
                            pieces.append(p)
                    if d.get("usage"):
                        _apply_usage(rec, d["usage"])
                if rec.first_token_s is None:
                    rec.first_token_s = first_choice_s
            rec.end_s = now() - t0
    except asyncio.TimeoutError:
        rec.error = f"timeout: no complete response within {timeout_s} s"
        rec.end_s = now() - t0
    except aiohttp.ClientResponseError as e:
        rec.error = f"client error: {e}"
        rec.end_s = now() - t0
    except (aiohttp.ClientError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        rec.end_s = now() - t0
    if rec.status is not None and rec.error is None:
        rec.answer = "".join(pieces)
        rec.output_chars = len(rec.answer)
    return headers


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class _State:
    t0: float
    deadline: float
    max_requests: int | None
    sent: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    records: list[RequestRecord] = field(default_factory=list)

    def budget_left(self) -> bool:
        if self.stop.is_set():
            return False
        if time.perf_counter() >= self.deadline or (
            self.max_requests is not None and self.sent >= self.max_requests
        ):
            self.stop.set()
            return False
        return True


async def _wait(state: _State, seconds: float) -> bool:
    """Sleep ``seconds`` unless the run stops first; True if the run may go on."""
    if seconds > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.stop.wait(), seconds)
    return state.budget_left()


async def run_workload(
    target: Target | str,
    workload: Workload,
    *,
    concurrency: int = 16,
    max_requests: int | None = None,
    max_seconds: float = 60.0,
    request_timeout_s: float = 60.0,
    seed: int = 0,
    stream: bool = True,
    progress: bool | None = None,
    label: str | None = None,
    replica_urls: list[str] | None = None,
    compute_ideal: bool = True,
    renderer: Any | None = None,
    block_size: int | None = None,
    settle_s: float = 0.1,
) -> RunResult:
    """Run ``workload`` against ``target`` and return a :class:`RunResult`.

    ``target`` is a :class:`Target`, or a gateway URL string (then ``replica_urls`` are the
    replicas it fronts). ``progress``: a tqdm bar on stderr (None = only when stderr is a TTY).
    ``compute_ideal``: replay the sent requests' token ids (chat prompts tokenized with
    ``renderer``, default the bundled Qwen3 renderer) through an unlimited cache.
    ``block_size``: for the ideal; default from the replicas' ``vllm:cache_config_info``, else 16.
    ``seed`` seeds the client-side policies that draw at random; the workload carries its own.
    """
    if isinstance(target, str):
        target = GatewayTarget(target, replica_urls or [])
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    metrics_urls = target.replica_urls
    warnings = list(workload.warnings)
    if not metrics_urls:
        warnings.append("no replica /metrics URLs given: fleet hit rate unavailable")
    planned = workload.planned_requests
    total = min(planned, max_requests) if max_requests is not None else planned
    show = sys.stderr.isatty() if progress is None else progress
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=False)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    gateway_url = target.url if isinstance(target, GatewayTarget) else None
    async with aiohttp.ClientSession(connector=connector) as http:
        before = await ms.scrape_all(metrics_urls, http) if metrics_urls else []
        gw_before = await ms.gateway_counters(http, gateway_url) if gateway_url else None
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        state = _State(t0, t0 + max_seconds, max_requests)
        sdk = MessagesClients()
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(
            total=total,
            disable=not show,
            desc=label or workload.label(),
            unit="req",
            leave=False,
            dynamic_ncols=True,
        )

        async def run_session(s: Session) -> None:
            gen = s.script()
            try:
                spec = next(gen)
            except StopIteration:
                return
            while True:
                if not await _wait(state, spec.delay_s):
                    return
                scheduled = time.perf_counter() - t0
                async with sem:
                    if not state.budget_left():
                        return
                    state.sent += 1
                    rec = RequestRecord(
                        len(state.records),
                        spec.session,
                        spec.group,
                        spec.turn,
                        spec.endpoint,
                        scheduled,
                        target=target.name,
                        spec=spec,
                    )
                    state.records.append(rec)
                    body = spec.make_body()
                    url = target.choose(spec)
                    send = (
                        functools.partial(_do_messages, sdk)
                        if spec.endpoint == "messages"
                        else functools.partial(_do_request, http)
                    )
                    headers = await send(
                        url, rec, body, stream=stream, timeout_s=request_timeout_s, t0=t0
                    )
                    rec.replica = (
                        target.served_by(url, headers)
                        if headers is not None
                        else (url if target.kind == "client" else None)
                    )
                    del body
                    bar.update(1)
                if state.max_requests is not None and state.sent >= state.max_requests:
                    state.stop.set()
                try:
                    spec = gen.send(rec.answer if rec.ok else None)
                except StopIteration:
                    return

        tasks: list[asyncio.Task[None]] = []

        async def schedule() -> None:
            for s in sorted(workload.sessions, key=lambda s: s.start_s):
                delay = t0 + s.start_s - time.perf_counter()
                if not await _wait(state, delay):
                    return
                tasks.append(asyncio.create_task(run_session(s)))

        async def deadline_timer() -> None:
            await asyncio.sleep(max_seconds)
            state.stop.set()

        timer = asyncio.create_task(deadline_timer())
        try:
            await schedule()
            hard = max_seconds + request_timeout_s + 5.0 - (time.perf_counter() - t0)
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=max(0.0, hard))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
        finally:
            timer.cancel()
            bar.close()
            for t in tasks:
                if not t.done():
                    t.cancel()
            await sdk.aclose()
        for rec in state.records:
            if rec.sent_s is not None and rec.end_s is None and rec.error is None:
                rec.error = "cancelled: still running at the hard stop"
                rec.answer = None
        duration = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
        if (warning := client_cpu_warning(client_cpu, duration)) is not None:
            warnings.append(warning)
        if settle_s > 0 and metrics_urls:
            await asyncio.sleep(settle_s)
        after = await ms.scrape_all(metrics_urls, http) if metrics_urls else []
        gw_after = await ms.gateway_counters(http, gateway_url) if gateway_url else None
        if state.max_requests is not None and state.sent >= state.max_requests:
            stop_reason = "max_requests"
        elif state.stop.is_set():
            stop_reason = "max_seconds"
        else:
            stop_reason = "workload"

    deltas = [ms.delta(b, a) for b, a in zip(before, after, strict=True)]
    for d in deltas:
        if not d.ok:
            warnings.append(f"metrics of {d.url} unavailable: {d.error}")
    if block_size is None:
        block_size = next((m.block_size for m in after + before if m.block_size), None) or 16
    records = sorted(state.records, key=lambda r: (r.sent_s is None, r.sent_s or 0.0, r.index))
    for i, r in enumerate(records):
        r.index = i
    result = RunResult(
        label=label or target.name,
        workload=workload.label(),
        workload_description=workload.description,
        workload_params=dict(workload.params),
        target=target.describe(),
        policy=target.policy,
        seed=seed,
        concurrency=concurrency,
        max_requests=max_requests,
        max_seconds=max_seconds,
        stream=stream,
        started_at=started_at,
        duration_s=duration,
        records=records,
        replica_deltas=deltas,
        block_size=block_size,
        warnings=warnings,
        stop_reason=stop_reason,
        planned_requests=planned,
        gateway_counters=(
            {k: v - gw_before.get(k, 0.0) for k, v in gw_after.items()}
            if gw_before is not None and gw_after is not None
            else {}
        ),
        client_cpu_s=client_cpu,
    )
    if compute_ideal:
        await asyncio.to_thread(attach_ideal, result, renderer)
    return result


# One asyncio process sends from one core: past this share of it, its own delays (a request
# sent late, a first byte read late) are in the figures, not only the fleet's.
CLIENT_CPU_WARN = 0.7


def client_cpu_warning(cpu_s: float, duration_s: float) -> str | None:
    """The warning when the load generator was busy enough to be the bottleneck."""
    if duration_s <= 0 or cpu_s / duration_s < CLIENT_CPU_WARN:
        return None
    return (
        f"the load generator's process used {cpu_s / duration_s:.0%} of a core while sending "
        f"({cpu_s:.1f} s of CPU in {duration_s:.1f} s; simulated replicas started in-process "
        "count too): it may be the bottleneck, and its own delays are in the latencies; send "
        "fewer sessions, start the replicas as processes, or run it on another host"
    )


def attach_ideal(result: RunResult, renderer: Any | None = None) -> None:
    """Compute the ideal hit rate of ``result``'s successful requests (in their send order, with
    the answers' tokens cached at completion) and fill ``harness_prompt_tokens`` /
    ``ideal_cached_tokens`` on each record. Warns when the harness's token count differs from
    the server's ``usage.prompt_tokens`` (the ideal would then be over different sequences)."""
    rs = [r for r in result.records if r.ok and r.spec is not None]
    needs_renderer = any(r.spec.token_ids_fn is None or r.answer for r in rs if r.spec)
    if needs_renderer and renderer is None:
        renderer = ideal_renderer()
    reqs = []
    mismatched = 0
    for r in rs:
        assert r.spec is not None
        ids = r.spec.prompt_token_ids(renderer)
        r.harness_prompt_tokens = len(ids)
        if r.prompt_tokens is not None and r.prompt_tokens != len(ids):
            mismatched += 1
        out = renderer.encode(r.answer, add_special_tokens=False) if r.answer else []
        salt = r.spec.make_body().get("cache_salt") if r.spec.body is not None else None
        reqs.append(IdealRequest(r.sent_s or 0.0, ids, r.end_s, out, salt))
    res = ideal_hit_rate(reqs, result.block_size)
    for r, h in zip(rs, res.per_request_hits, strict=True):
        r.ideal_cached_tokens = h
    result.ideal = res
    if mismatched:
        result.warnings.append(
            f"harness tokenization differs from the server's usage.prompt_tokens for "
            f"{mismatched} of {len(rs)} requests: the ideal hit rate is over different sequences"
        )
