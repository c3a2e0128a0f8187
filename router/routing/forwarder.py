"""The forwarding path of the endpoints that are not routed on a prompt: pick a replica,
account for it, send it through the relay transport, retry on another replica before the
first byte, release on every path out.

    for up to max_retries + 1 replicas:
        job.pick(tried)                 the least-loaded replica (serving the body's model)
        charge                          in flight, pending (prefill) until the first byte
        transport.send                  the request goes out (router/upstream/transport.py: Relay)
        failed before the first byte:   the replica's failure recorded, next (``Retries``),
                                        unless it may have reached the replica and it timed
                                        out while the fleet is saturated, or retries are at
                                        their budget (a 503: shed, not doubled)
        every path out:                 release

The forwarded endpoints (router/api/forwarded.py: POSTs and ``GET /version``; /tokenize) and
a stored response's GET, DELETE and cancel (pinned to its replica, router/api/routes.py)
differ only in their ``Job``: its method, what it picks, what it sends and what it adds to
the answer's headers. A routed request
goes through its exchange (router/routing/exchange.py), on the same accounting
(router/routing/accounting.py) and the same ``Retries``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping

from aiohttp import web

from router.core.errors import APIError
from router.fleet.replicas import Fleet, Replica
from router.routing.accounting import Attempt, charge, prefilled, release
from router.routing.retry_budget import RetryBudget
from router.telemetry.metrics import Metrics
from router.upstream.client import UpstreamPool
from router.upstream.proxy import StreamErrorShape, UpstreamUnavailable
from router.upstream.transport import Relay, Transport, Wire

log = logging.getLogger("prefix_router")


def load_order(replica: Replica) -> tuple[int, str]:
    """Fewest requests in flight from this gateway first; ties by URL (deterministic)."""
    return replica.inflight, replica.url


def least_loaded(replicas: Iterable[Replica]) -> Replica | None:
    """The first replica in ``load_order``; None for none."""
    return min(replicas, key=load_order, default=None)


def idle_among(replicas: Iterable[Replica]) -> bool:
    """Some replica has nothing waiting: no request of this gateway's waiting for its first
    byte there and no queue of its own (as last scraped). A retry sent there adds to no one's
    wait, so it needs none of the retry budget."""
    return any(not r.pending_requests and not r.stats.waiting for r in replicas)


def queued_everywhere(replicas: Iterable[Replica]) -> bool:
    """Some replica, and each of them has requests waiting in its own queue."""
    found = False
    for r in replicas:
        if not r.stats.waiting:
            return False
        found = True
    return found


class Job:
    """What one non-routed request asks of the forwarding path: where it goes (``pick``),
    what it sends and what it adds to the answer's headers. The defaults forward ``body`` as
    is to the least-loaded healthy replica; subclasses override what their endpoint needs. (A routed request has its own
    driver, router/routing/exchange.py, on the same accounting and retry rules.)"""

    stream_error: StreamErrorShape = "openai"  # the API's shape for an error mid-stream

    def __init__(
        self, path: str, body: bytes, headers: Mapping[str, str], method: str = "POST"
    ) -> None:
        self.path = path  # appended to the replica's URL
        self.body = body
        self.headers = headers
        self.method = method

    async def pick(self, fleet: Fleet, tried: frozenset[str]) -> Attempt | None:
        """The next replica to try (``tried`` failed already); None when none is left.
        May raise an ``APIError`` that says why no replica can take the request."""
        replica = least_loaded(r for r in fleet.healthy() if r.url not in tried)
        return Attempt(replica) if replica is not None else None

    def extra_headers(self, attempt: Attempt) -> dict[str, str]:
        """Headers added to the answer (the request id is always there)."""
        return {}

    def saturated(self, fleet: Fleet, tried: frozenset[str]) -> bool:
        """Every replica the request could go to next has a queue of its own (vLLM's
        ``num_requests_waiting``, as last scraped): a re-sent request would wait again."""
        return queued_everywhere(r for r in fleet.healthy() if r.url not in tried)

    def idle_elsewhere(self, fleet: Fleet, tried: frozenset[str]) -> bool:
        """A replica the request could go to next has nothing waiting (``idle_among``)."""
        return idle_among(r for r in fleet.healthy() if r.url not in tried)


class ModelJob(Job):
    """A request naming a model (/tokenize, /detokenize): to the least-loaded of the replicas
    serving it (another model's would answer 404); any healthy one when it names none."""

    def __init__(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        model: str | None,
        serving: Callable[[str, frozenset[str]], list[Replica]],
    ) -> None:
        super().__init__(path, body, headers)
        self.model = model
        self.serving = serving

    async def pick(self, fleet: Fleet, tried: frozenset[str]) -> Attempt | None:
        if not self.model:
            return await super().pick(fleet, tried)
        replica = least_loaded(self.serving(self.model, tried))
        return Attempt(replica) if replica is not None else None


class PinnedJob(Job):
    """A request about what one replica holds (a stored response): to that replica only;
    if it fails, no other replica can answer (a 502)."""

    def __init__(
        self, path: str, headers: Mapping[str, str], method: str, replica: Replica
    ) -> None:
        super().__init__(path, b"", headers, method)
        self.replica = replica

    async def pick(self, fleet: Fleet, tried: frozenset[str]) -> Attempt | None:
        return None if tried else Attempt(self.replica)


class Retries:
    """The rules for trying another replica before the first byte, shared by the forwarder
    and the routed exchange: at most ``max_retries`` more replicas, the replica's failure
    recorded, and a request the replica may have received shed rather than sent again when
    the fleet is saturated or retries are at their budget (``RetryBudget``)."""

    def __init__(
        self,
        metrics: Metrics,
        max_retries: int,
        after_failure: Callable[[], None] = lambda: None,
        budget: RetryBudget | None = None,
    ) -> None:
        self.metrics = metrics
        self.max_retries = max_retries
        self.budget = budget if budget is not None else RetryBudget(20.0, 3)
        self._after_failure = after_failure  # the ring follows the replicas' health

    async def failed(
        self,
        fleet: Fleet,
        replica: Replica,
        e: UpstreamUnavailable,
        tried: frozenset[str],
        retrying: bool,
        saturated: Callable[[frozenset[str]], bool],
        idle: Callable[[frozenset[str]], bool],
    ) -> bool:
        """``replica`` failed before the first byte (already in ``tried``): its failure
        recorded, then the ``APIError`` that ends the request, or True when it goes on to
        another replica holding one of the budget's retries (held until the request ends:
        ``end``). A retry that can go to an idle replica (``idle``: a hung or dying replica
        beside free ones) fails over without the budget: the budget is against piling
        re-sent work onto replicas that are busy already."""
        if e.counts:
            await fleet.record_failure(replica, e.why)
            self._after_failure()
        if len(tried) > self.max_retries:
            raise APIError(
                502,
                f"upstream replica unavailable ({e.why}) after {len(tried)} attempts",
                code="upstream_unavailable",
            ) from e
        if not e.sent:  # a request that never reached a replica is not doubled
            return retrying
        if e.why == "timeout" and saturated(tried):
            # It would queue again, behind its own first copy if that replica does not
            # abort it: shed, not computed twice.
            self.metrics.retries_shed.labels("saturated").inc()
            raise APIError(
                503,
                "the replica did not answer in time and every replica that could take the "
                "request is saturated: it was not sent again (it would be computed twice); "
                "retry later",
                code="fleet_saturated",
            ) from e
        if retrying or idle(tried):
            return retrying
        if not self.budget.take():
            self.metrics.retries_shed.labels("budget").inc()
            raise APIError(
                503,
                f"upstream replica unavailable ({e.why}); not retried: {self.budget.retrying} "
                "requests are being retried already (the retry budget); retry later",
                code="upstream_unavailable",
            ) from e
        return True

    def begin(self) -> None:
        """A request enters the forwarding path (the budget's concurrency)."""
        self.budget.active += 1

    def end(self, retrying: bool) -> None:
        """It left: its retry, if it held one, back to the budget."""
        self.budget.active -= 1
        if retrying:
            self.budget.give_back()


def unavailable_error(tried: set[str], why: str) -> APIError:
    """No replica is left to try: a 502 after failures, a 503 when none was there."""
    if tried:
        return APIError(502, f"upstream replica unavailable ({why})", code="upstream_unavailable")
    return APIError(503, "no healthy replica is available", code="no_replica")


class _Prefilled:
    """A job's ``Report``: nothing to record while it is sent; its first byte ends its
    pending prefill."""

    __slots__ = ("attempt",)

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt

    async def sent(self) -> None:
        pass

    def first_byte(self) -> None:
        prefilled(self.attempt)


class Forwarder:
    """Sends non-routed jobs to replicas with retries before the first byte and load
    accounting, through the relay transport (router/upstream/transport.py)."""

    def __init__(
        self,
        upstream: UpstreamPool,
        metrics: Metrics,
        fleet: Callable[[], Fleet],
        retries: Retries,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.retries = retries
        self._fleet = fleet  # the fleet exists once the gateway has started

    async def forward(self, request: web.Request, request_id: str, job: Job) -> web.StreamResponse:
        """Relay ``job`` to a replica and its answer to ``request``'s client."""
        retries = self.retries
        retries.begin()
        retrying = False  # holds one of the budget's retries until the request ends
        try:
            fleet = self._fleet()
            transport = Relay(self.upstream, request)
            tried: set[str] = set()
            why = ""
            while True:
                attempt = await job.pick(fleet, frozenset(tried))
                if attempt is None:
                    raise unavailable_error(tried, why)
                try:
                    return await self._send(transport, request_id, job, attempt)
                except UpstreamUnavailable as e:
                    why = e.why
                    tried.add(attempt.replica.url)
                    retrying = await retries.failed(
                        fleet,
                        attempt.replica,
                        e,
                        frozenset(tried),
                        retrying,
                        functools.partial(job.saturated, fleet),
                        functools.partial(job.idle_elsewhere, fleet),
                    )
                    log.info(
                        "request %s: %s failed before the first byte (%s); retrying",
                        request_id,
                        attempt.replica.url,
                        e.why,
                    )
        finally:
            retries.end(retrying)

    async def _send(
        self,
        transport: Transport[web.StreamResponse],
        request_id: str,
        job: Job,
        attempt: Attempt,
    ) -> web.StreamResponse:
        wire = Wire(
            attempt.replica.url + job.path,
            job.body,
            job.headers,
            {"x-request-id": request_id, **job.extra_headers(attempt)},
            job.method,
            job.stream_error,
        )
        charge(self.metrics, attempt)  # nothing between it and the ``try`` may raise
        try:
            resp, _ = await transport.send(wire, _Prefilled(attempt))
            return resp
        finally:
            release(self.metrics, attempt)
