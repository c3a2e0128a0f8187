"""The model registry at run time, as one owner: it follows the fleet (refresh on replica
events, a new model's tokenizer loaded off the event loop), answers the request path's
questions about a request's model (its route, the replicas that may take it, its context, a
replica's block size and index namespace, the decoder diagnostics use), loads a LoRA adapter
where the scheduler put a request without it, and keeps the per-model counters and the drift
watch. The request path (router/routing/request_path.py) asks; only this module changes the registry
after start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from router.config import Config
from router.core.errors import APIError, clip
from router.fleet.replicas import Fleet, Replica
from router.intake.routed_request import RoutedRequest
from router.models import download
from router.models.adapters import AdapterLoads, LoadResult
from router.models.parity import PROBES, Parity, gateway_ids, probe_replica
from router.models.registry import ModelEntry, ModelRegistry, Route
from router.prompt import Renderer
from router.telemetry.metrics import Metrics
from router.upstream.proxy import UpstreamUnavailable

log = logging.getLogger("prefix_router")

# A tokenizer that failed to load is tried again after this, doubling up to the cap.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 60.0

Spawn = Callable[[Coroutine[Any, Any, Any]], None]
Decode = Callable[[Sequence[int]], str]


class ModelUpkeep:
    """Keeps ``registry`` in step with the fleet and answers for it on the request path."""

    def __init__(
        self,
        registry: ModelRegistry,
        config: Config,
        metrics: Metrics,
        executor: ThreadPoolExecutor,
        spawn: Spawn,
        fleet: Callable[[], Fleet | None],
        session: Callable[[], aiohttp.ClientSession | None],
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.executor = executor
        self.spawn = spawn
        self._fleet = fleet
        self._session = session
        self.ready = False  # start-up loaded the registry's tokenizers (Gateway._start)
        self.adapter_loads = AdapterLoads(config.registry.lora_refusal_ttl_s)
        # Called after each load (a model's state changed): readiness listens here.
        self.on_loaded: list[Callable[[ModelEntry], None]] = []
        self._retrying: set[str] = set()
        if config.registry.tokenizer_download:
            registry.fetch = download.Downloader()

    # -- following the fleet --------------------------------------------------------------------
    def refresh(self) -> None:
        """Replicas came, went or reported: rebuild the registry, and load a new model's
        tokenizer off the event loop (its requests use the text prefix until it is in)."""
        fleet = self._fleet()
        if fleet is None:
            return
        new = self.registry.refresh(fleet.replicas.values())
        if self.ready:  # during start-up, Gateway._start loads them
            for name in new:
                self.spawn(self._load_later(name))
            for entry in list(self.registry.entries.values()):
                if entry.loaded and entry.replicas != entry.parity_replicas:
                    self.spawn(self.probe(entry.name))

    async def load_all(self) -> None:
        """Start-up: build the registry from what the replicas reported and load every
        model's tokenizer (downloading it first where allowed), before serving."""
        fleet = self._fleet()
        assert fleet is not None
        if self.registry.fetch is not None:
            log.info("%s", download.describe())
        self.registry.refresh(fleet.replicas.values())
        if self.registry.refused:
            raise SystemExit(f"prefix-router: {self.registry.refused}")
        loop = asyncio.get_running_loop()
        for name in self.registry.unloaded():
            self.loaded(await loop.run_in_executor(self.executor, self.registry.load, name))
        # Readiness waits for each model's first parity probe: run them before serving.
        await asyncio.gather(*(self.probe(name) for name in list(self.registry.entries)))
        self.ready = self.registry.started = True
        for name in self.registry.unloaded():  # failed (not an explicit tokenizer): retried
            self.spawn(self._load_later(name, RETRY_FIRST_S))

    async def _load_later(self, name: str, delay: float = 0.0) -> None:
        """Load ``name``'s tokenizer; while it fails, again after a growing delay (until it
        loads, or the model leaves the registry). One retry loop per model."""
        if name in self._retrying:
            return
        self._retrying.add(name)
        # A download (allowed) waits on the network: not in a tokenizing thread.
        executor = None if self.registry.fetch is not None else self.executor
        loop = asyncio.get_running_loop()
        try:
            while True:
                if delay:
                    await asyncio.sleep(delay)
                entry = self.registry.entries.get(name)
                if entry is None or entry.loaded:
                    return
                done = await loop.run_in_executor(executor, self.registry.load, name)
                if done.loaded:  # probed before its hooks: readiness waits for the probe
                    await self.probe(name)
                self.loaded(done)
                if entry.loaded:
                    return
                delay = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * delay))
        finally:
            self._retrying.discard(name)

    def loaded(self, entry: ModelEntry) -> None:
        if entry.renderer is not None:
            # The longest token (check_fits' bound) scans the vocabulary once: not on a request.
            entry.renderer.max_chars_per_token()
        if entry.loaded:
            self.metrics.model_info.labels(
                entry.name, entry.basis, entry.tokenizer_origin, str(entry.block_size)
            ).set(1)
        for hook in self.on_loaded:
            hook(entry)

    # -- the parity probe (router/models/parity.py) ---------------------------------------------
    async def probe(self, name: str) -> None:
        """Compare ``name``'s probe requests tokenized here and by each of its replicas; on
        a mismatch, set its tokenizer aside (the labelled text prefix) until they agree."""
        entry = self.registry.entries.get(name)
        fleet, session = self._fleet(), self._session()
        if entry is None or not entry.loaded or fleet is None or session is None:
            return
        renderer = entry.renderer or entry.held
        urls = entry.replicas
        if renderer is None or not self.config.registry.parity_probe:
            entry.parity, entry.parity_replicas = "none" if renderer is None else "off", urls
            return
        loop = asyncio.get_running_loop()

        def ours() -> list[tuple[str, list[int]]]:
            out = []
            for probe_name, body in PROBES:
                try:
                    out.append((probe_name, gateway_ids(renderer, body)))
                except Exception:  # noqa: BLE001  a template that refuses this shape: skipped
                    continue
            return out

        mine = await loop.run_in_executor(self.executor, ours)
        timeout = self.config.forwarding.first_byte_timeout_floor_s
        results = await asyncio.gather(
            *(probe_replica(session, u, name, renderer, mine, fleet.headers, timeout) for u in urls)
        )
        if entry.replicas != urls:  # changed meanwhile: the next probe decides
            return
        entry.parity_replicas = urls
        self._apply(entry, results)

    def _apply(self, entry: ModelEntry, results: Sequence[Parity]) -> None:
        bad = next((r for r in results if r.state == "mismatch"), None)
        state = (
            "mismatch"
            if bad is not None
            else "exact"
            if any(r.state == "exact" for r in results)
            else "unavailable"
        )
        before = entry.parity
        entry.parity = state
        entry.parity_detail = (
            bad.detail
            if bad is not None
            else (results[0].detail if state == "unavailable" and results else None)
        )
        self.metrics.model_parity_mismatch.labels(entry.name).set(1 if bad else 0)
        if bad is not None:
            if entry.renderer is not None:
                entry.held, entry.renderer = entry.renderer, None
            if before != "mismatch":
                log.warning(
                    "model %s: its replicas tokenize the parity probe otherwise than the gateway "
                    "(%s); its requests are routed by load and a text prefix until they agree: "
                    "give the gateway the replicas' tokenizer directory (with its config.json) "
                    "and their --chat-template (models: %s: tokenizer:, chat_template:)",
                    entry.name,
                    entry.parity_detail,
                    entry.name,
                )
            return
        if entry.held is not None:
            entry.renderer, entry.held = entry.held, None
            log.info("model %s: the parity probe agrees with its replicas again", entry.name)
        if state == "unavailable" and before != "unavailable":
            log.info("model %s: parity not checked (%s)", entry.name, entry.parity_detail)

    # -- what the request path asks -----------------------------------------------------------
    def route(self, name: Any, renderer: Renderer | None, block_size: int) -> Route:
        """The registry entry a body's ``model`` names (aliases applied), or the error that
        says why none serves it. Offline (no fleet): ``renderer``, for any name."""
        name = name if isinstance(name, str) else None
        models, fleet = self.registry, self._fleet()
        if fleet is None:
            return models.offline(name or models.offline_default(), renderer, block_size)
        route = models.resolve(name)
        if route is None:
            target = models.alias(name) if name else (fleet.base_model() or "")
            self.check_known(target)
            self.serving(target)
            self.refresh()  # served, but the registry has not seen it yet
            route = models.resolve(name)
        if route is None:  # not in the registry yet: by load and the text prefix meanwhile
            return models.offline(name or "", None, block_size)
        return route

    def check_known(self, model: str | None) -> None:
        """A 503 for a name no replica has listed while some have not answered /v1/models
        yet: not a name to take on trust (each one left metric labels, registry entries,
        queues and Redis keys behind, never freed). ``None``: no model named."""
        if model is not None and not self._may_be_served(model):
            raise APIError(
                503,
                "models not known yet: no replica has answered /v1/models; retry shortly",
                code="models_not_known",
            )

    def _may_be_served(self, model: str) -> bool:
        """Whether ``model`` may name something a replica serves: listed by a replica that
        answered /v1/models (a base model, an adapter, an active one), configured under
        models: (or an alias), a loadable adapter; or every healthy replica has answered, and
        ``serving`` says (a 404 for a name none lists)."""
        fleet = self._fleet()
        assert fleet is not None
        if model in self.registry.specs or model in self.registry.loadable_adapters:
            return True
        unknown = False
        for r in fleet.replicas.values():
            if not r.healthy:
                continue
            if not r.models_known:
                unknown = True
            elif model in r.models or model in r.stats.lora_active:
                return True
        return not unknown

    def serving(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        entry: ModelEntry | None = None,
        lora: str | None = None,
    ) -> list[Replica]:
        """The replicas that can take a request for ``model`` (those of its registry entry's
        routed group: replicas kept apart only when none of those can), or the error that
        says why none can. An adapter no replica has, where runtime loading is allowed: its
        base model's replicas (the chosen one loads it, ``ensure_adapter``)."""
        fleet = self._fleet()
        assert fleet is not None
        replicas = fleet.serving(model)
        if exclude:
            replicas = [r for r in replicas if r.url not in exclude]
        if not replicas and lora is not None and self.may_load(lora):
            base = entry.name if entry is not None else ""
            loads = self.adapter_loads
            candidates = [r for r in fleet.serving(base) if r.url not in exclude]
            replicas = [r for r in candidates if loads.refused(r.url, lora) is None]
            if candidates and not replicas:  # every one refused it lately: not a replica fault
                raise self._refused(lora, loads.refused(candidates[0].url, lora) or 400)
        if entry is not None and entry.replicas:
            routed = set(entry.replicas)
            replicas = [r for r in replicas if r.url in routed] or replicas
        if not replicas:
            if not fleet.healthy():
                raise APIError(503, "no healthy replica is available", code="no_replica")
            if exclude:
                raise APIError(
                    502, "every replica that serves this model failed", code="upstream_failed"
                )
            raise APIError(
                404,
                f"The model `{clip(model)}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return replicas

    def context_of(self, model: str, entry: ModelEntry) -> int | None:
        """The model's context (``max_model_len`` from the replicas' cards; an adapter's card
        has none: its base's), None when unknown or offline."""
        fleet = self._fleet()
        if fleet is None:
            return None
        n = (fleet.card(model) or {}).get("max_model_len")
        if n is None:
            n = entry.max_model_len
        return n if type(n) is int and n > 0 else None

    def block_size_of(self, replica: str, default: int) -> int:
        """The block size of the model ``replica`` serves (KV events are checked against it)."""
        entry = self.registry.entry_of_replica(replica)
        return entry.block_size if entry is not None else default

    def namespace_of(self, replica: str) -> str | None:
        """The index namespace of the model ``replica`` serves."""
        entry = self.registry.entry_of_replica(replica) or self.registry.default()
        return entry.namespace if entry is not None else None

    def decoder(self, model: str | None, offline: Renderer | None) -> Decode | None:
        """How diagnostics turn ``model``'s token ids back into text: its own tokenizer's
        decode; None for a model matched by its text prefix or not served (never another
        model's tokenizer). Offline (no fleet): ``offline``'s, the tokenizer it was given."""
        if self._fleet() is None:
            return offline.decode if offline is not None else None
        route = self.registry.resolve(model) if model else None
        renderer = route.entry.renderer if route is not None else None
        return renderer.decode if renderer is not None else None

    # -- LoRA adapters at run time ------------------------------------------------------------
    def may_load(self, adapter: str) -> bool:
        return (
            self.config.registry.lora_runtime_loading and adapter in self.registry.loadable_adapters
        )

    def plan_adapter(self, rr: RoutedRequest, replica: str) -> None:
        """Note in ``rr`` that ``replica``, chosen for it, must load its adapter first
        (explain shows it; ``ensure_adapter`` does it)."""
        rr.adapter_load.clear()
        fleet = self._fleet()
        chosen = fleet.replicas.get(replica) if fleet is not None else None
        if rr.lora is not None and chosen is not None and not chosen.has_model(rr.lora):
            path = self.registry.loadable_adapters[rr.lora][1]
            rr.adapter_load.update(replica=replica, adapter=rr.lora, path=path)

    async def ensure_adapter(self, rr: RoutedRequest, replica: Replica) -> None:
        """Load the request's LoRA adapter on ``replica`` first, when the decision chose one
        without it (vLLM's /v1/load_lora_adapter): one load per (replica, adapter) at a time,
        the requests arriving meanwhile wait for it. A refusal (a 4xx: a bad path, runtime
        updates off) is remembered (``AdapterLoads``) and answered with a 404 naming the
        adapter, never counted against the replica; a 5xx or a transport failure is the
        replica's, retried elsewhere as any failure before the first byte (counted once, by
        the request that made the call)."""
        load = rr.adapter_load
        if not load or load["replica"] != replica.url or replica.has_model(load["adapter"]):
            return
        adapter = load["adapter"]
        model = rr.model_entry.name if rr.model_entry is not None else ""
        result, made = await self.adapter_loads.load(
            replica.url, adapter, lambda: self._load_adapter(replica, model, adapter, load["path"])
        )
        if result.ok:
            return
        if result.refused:
            raise self._refused(adapter, result.status)
        raise UpstreamUnavailable(
            f"load_lora_adapter: {result.detail[:80]}", counts=made, sent=False
        )

    async def _load_adapter(
        self, replica: Replica, model: str, adapter: str, path: str
    ) -> LoadResult:
        session, fleet = self._session(), self._fleet()
        assert session is not None and fleet is not None
        try:
            async with session.post(
                replica.url + "/v1/load_lora_adapter",
                json={"lora_name": adapter, "lora_path": path},
                headers=dict(fleet.headers),
                timeout=aiohttp.ClientTimeout(
                    total=self.config.forwarding.first_byte_timeout_floor_s
                ),
            ) as resp:
                text = await resp.text()
                # vLLM: 400 "has already been loaded" (another gateway loaded it first)
                ok = resp.status == 200 or "already been loaded" in text
                result = LoadResult(ok, resp.status, text)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            result = LoadResult(False, 0, f"{type(e).__name__}: {e}")
        outcome = "ok" if result.ok else "refused" if result.refused else "failed"
        self.metrics.adapter_loads.labels(model, adapter, outcome).inc()
        if result.ok:
            log.info("loaded LoRA adapter %s on %s", adapter, replica.url)
            replica.models[adapter] = model
            self.refresh()
        else:
            log.warning(
                "loading LoRA adapter %s on %s %s (HTTP %s): %s",
                adapter,
                replica.url,
                outcome,
                result.status or "-",
                result.detail[:200],
            )
        return result

    def _refused(self, adapter: str, status: int) -> APIError:
        # The replica's text is logged, not sent: it names replica-side paths.
        return APIError(
            404,
            f"The LoRA adapter `{clip(adapter)}` cannot be loaded: the replicas refused it "
            f"(HTTP {status}); retry later",
            param="model",
            code="adapter_unavailable",
        )

    # -- learning -------------------------------------------------------------------------------
    def learn(self, entry: ModelEntry, predicted: int, reported: int | None) -> None:
        """Per-model counters and the drift watch (router/models/drift.py)."""
        m = self.metrics
        m.child(m.model_requests, entry.name, entry.basis).inc()
        m.child(m.model_predicted_cached_tokens, entry.name).inc(predicted)
        if reported is None:
            return
        m.child(m.model_reported_cached_tokens, entry.name).inc(reported)
        if entry.basis != "tokens":  # a text prefix approximates: no drift to speak of
            return
        change = entry.drift.observe(predicted, reported)
        m.child(m.model_drift, entry.name).set(entry.drift.ratio())
        if change is None:
            return
        m.child(m.model_drifting, entry.name).set(1 if change else 0)
        if change:
            log.warning(
                "model %s: predictions run above what its replicas report (%.0f%% of the "
                "predicted cached tokens of its last %d requests unconfirmed): do the replicas "
                "use another chat template, tokenizer or block size? (tokenizer: %s %s)",
                entry.name,
                100 * entry.drift.ratio(),
                len(entry.drift.samples),
                entry.tokenizer_origin,
                entry.tokenizer,
            )
        else:
            log.info("model %s: predictions agree with its replicas again", entry.name)
