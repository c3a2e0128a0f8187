"""The one forwarding path, for every endpoint: pick a replica, account for it, send, retry on
another replica before the first byte, release on every path out.

    for up to max_retries + 1 replicas:
        job.pick(tried)                 routed: the policy's decision; forwarded: least loaded
        account                         in flight, pending (prefill) until the first byte
        job.before_send -> proxy        the request goes out
        job.first_byte                  the replica's first bytes (its prefill is done)
        failed before the first byte:   the replica's failure recorded, job.unavailable, next,
                                        unless it may have reached the replica and it timed
                                        out while the fleet is saturated, or retries are at
                                        their budget (a 503: shed, not doubled)
        every path out:                 accounting released, job.done(attempt, ending, outcome)

The routed endpoints (router/routed.py), the forwarded ones (router/api/forwarded.py: POSTs
and ``GET /version``; /tokenize) and a stored response's GET, DELETE and cancel (pinned to its
replica, router/api/routes.py) differ only in their ``Job``: its method, what it picks, what it
adds to the answer's headers and what it learns from it. The accounting is written once, here, so no path out of a
request can leave a count behind.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web

from router.errors import APIError
from router.fleet import Fleet, Replica
from router.forward import Outcome, StreamErrorShape, UpstreamUnavailable, proxy
from router.metrics import Metrics
from router.retry_budget import RetryBudget
from router.schedule import Decision
from router.upstream import UpstreamPool

log = logging.getLogger("prefix_router")


def load_order(replica: Replica) -> tuple[int, str]:
    """Fewest requests in flight from this gateway first; ties by URL (deterministic)."""
    return replica.inflight, replica.url


def least_loaded(replicas: Iterable[Replica]) -> Replica | None:
    """The first replica in ``load_order``; None for none."""
    return min(replicas, key=load_order, default=None)


def queued_everywhere(replicas: Iterable[Replica]) -> bool:
    """Some replica, and each of them has requests waiting in its own queue."""
    found = False
    for r in replicas:
        if not r.stats.waiting:
            return False
        found = True
    return found


class Ending(enum.Enum):
    """How one attempt at one replica ended."""

    ANSWERED = "answered"  # the replica's answer was relayed (any status but 502/503)
    UNAVAILABLE = "unavailable"  # failed before the first byte: retried elsewhere
    CLIENT_GONE = "client_gone"  # the client disconnected (the handler was cancelled)
    FAILED = "failed"  # anything else raised on the way


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of one request at one replica, and what it added to the replica's load."""

    replica: Replica
    decision: Decision | None = None  # the routing decision, for the routed endpoints
    prefill_tokens: int = 0  # prompt tokens the replica must compute (pending until 1st byte)
    pending: bool = False  # sent, its first byte not yet in

    def set_prefill_tokens(self, tokens: int) -> None:
        """A better count of the prompt tokens the replica computes (a lazy head's exact
        count, once its rest is tokenized): the pending prefill follows while pending."""
        if self.pending:
            self.replica.pending_prefill_tokens += tokens - self.prefill_tokens
            self.prefill_tokens = tokens


class Job:
    """What one request asks of the forwarding path. The defaults forward ``body`` as is to
    the least-loaded healthy replica; subclasses override what their endpoint needs."""

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

    def headers_timeout(self, attempt: Attempt) -> float | None:
        """How long to wait for the replica's response headers (None: the pool's bound)."""
        return None

    def on_sent(self, attempt: Attempt) -> Callable[[], Awaitable[None]] | None:
        """Runs once while the replica works on the request (``UpstreamPool.post``)."""
        return None

    def saturated(self, fleet: Fleet, tried: frozenset[str]) -> bool:
        """Every replica the request could go to next has a queue of its own (vLLM's
        ``num_requests_waiting``, as last scraped): a re-sent request would wait again."""
        return queued_everywhere(r for r in fleet.healthy() if r.url not in tried)

    async def before_proxy(self, attempt: Attempt) -> None:
        """Runs before the attempt is accounted for and sent (a LoRA adapter loaded on the
        replica); an ``UpstreamUnavailable`` here is the replica's failure, retried elsewhere."""

    def before_send(self, attempt: Attempt) -> None:
        """The attempt is accounted for and about to go out."""

    def first_byte(self, attempt: Attempt) -> None:
        """The replica's first bytes arrived (a stream's: the end of its prefill)."""

    async def unavailable(self, attempt: Attempt, why: str) -> None:
        """The replica failed before the first byte; the request goes to another one."""

    async def answered(self, attempt: Attempt, outcome: Outcome) -> None:
        """The replica's answer was relayed to the client."""

    def done(self, attempt: Attempt, ending: Ending, outcome: Outcome | None) -> None:
        """Every attempt ends here, once, whichever way it ended (its load released)."""


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


class Forwarder:
    """Sends jobs to replicas with retries before the first byte and load accounting."""

    def __init__(
        self,
        upstream: UpstreamPool,
        metrics: Metrics,
        max_retries: int,
        fleet: Callable[[], Fleet],
        after_failure: Callable[[], None] = lambda: None,
        budget: RetryBudget | None = None,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.max_retries = max_retries
        self.budget = budget if budget is not None else RetryBudget(20.0, 3)
        self._fleet = fleet  # the fleet exists once the gateway has started
        self._after_failure = after_failure  # the ring follows the replicas' health

    async def forward(self, request: web.Request, request_id: str, job: Job) -> web.StreamResponse:
        """Relay ``job`` to a replica and its answer to ``request``'s client."""
        budget = self.budget
        budget.active += 1
        retrying = False  # holds one of the budget's retries until the request ends
        try:
            fleet = self._fleet()
            tried: set[str] = set()
            why = ""
            while True:
                attempt = await job.pick(fleet, frozenset(tried))
                if attempt is None:
                    if tried:
                        raise APIError(
                            502,
                            f"upstream replica unavailable ({why})",
                            code="upstream_unavailable",
                        )
                    raise APIError(503, "no healthy replica is available", code="no_replica")
                try:
                    await job.before_proxy(attempt)
                    resp, outcome = await self._send(request, request_id, job, attempt)
                except UpstreamUnavailable as e:
                    why = e.why
                    tried.add(attempt.replica.url)
                    await job.unavailable(attempt, e.why)
                    if e.counts:
                        await fleet.record_failure(attempt.replica, e.why)
                        self._after_failure()
                    if len(tried) > self.max_retries:
                        raise APIError(
                            502,
                            f"upstream replica unavailable ({e.why}) after {len(tried)} attempts",
                            code="upstream_unavailable",
                        ) from e
                    if e.sent:  # a request that never reached a replica is not doubled
                        self._may_resend(job, fleet, frozenset(tried), e, retrying)
                        retrying = True
                    log.info(
                        "request %s: %s failed before the first byte (%s); retrying",
                        request_id,
                        attempt.replica.url,
                        e.why,
                    )
                    continue
                await job.answered(attempt, outcome)
                return resp
        finally:
            budget.active -= 1
            if retrying:
                budget.give_back()

    def _may_resend(
        self,
        job: Job,
        fleet: Fleet,
        tried: frozenset[str],
        e: UpstreamUnavailable,
        retrying: bool,
    ) -> None:
        """Raise the 503 that sheds a request the replica may have received, rather than
        send it again: after a timeout while every replica it could go to is saturated (it
        would queue again, behind its own first copy if that replica does not abort it), or
        when retries are at their budget (``RetryBudget``; a request counts once)."""
        if e.why == "timeout" and job.saturated(fleet, tried):
            self.metrics.retries_shed.labels("saturated").inc()
            raise APIError(
                503,
                "the replica did not answer in time and every replica that could take the "
                "request is saturated: it was not sent again (it would be computed twice); "
                "retry later",
                code="fleet_saturated",
            ) from e
        if not retrying and not self.budget.take():
            self.metrics.retries_shed.labels("budget").inc()
            raise APIError(
                503,
                f"upstream replica unavailable ({e.why}); not retried: {self.budget.retrying} "
                "requests are being retried already (the retry budget); retry later",
                code="upstream_unavailable",
            ) from e

    async def _send(
        self, request: web.Request, request_id: str, job: Job, attempt: Attempt
    ) -> tuple[web.StreamResponse, Outcome]:
        replica = attempt.replica
        gauge = self.metrics.child(self.metrics.inflight, replica.url)

        def release_pending() -> None:
            if attempt.pending:
                attempt.pending = False
                replica.pending_requests -= 1
                replica.pending_prefill_tokens -= attempt.prefill_tokens

        def first_byte() -> None:
            if attempt.pending:
                release_pending()
                job.first_byte(attempt)

        ending, outcome = Ending.FAILED, None
        # Every count raised here is lowered in the ``finally``, which starts right after
        # them: nothing between may raise (the job's hooks run inside).
        replica.inflight += 1
        replica.pending_requests += 1
        replica.pending_prefill_tokens += attempt.prefill_tokens
        attempt.pending = True
        gauge.inc()
        try:
            job.before_send(attempt)
            extra = {"x-request-id": request_id, **job.extra_headers(attempt)}
            resp, outcome = await proxy(
                self.upstream,
                request,
                replica.url + job.path,
                job.body,
                job.headers,
                extra,
                on_first_byte=first_byte,
                on_sent=job.on_sent(attempt),
                stream_error=job.stream_error,
                headers_timeout=job.headers_timeout(attempt),
                method=job.method,
            )
            first_byte()  # a whole (non-streamed) answer: its first byte came with the rest
            ending = Ending.ANSWERED
            return resp, outcome
        except UpstreamUnavailable:
            ending = Ending.UNAVAILABLE
            raise
        except asyncio.CancelledError:
            ending = Ending.CLIENT_GONE
            raise
        finally:
            release_pending()
            replica.inflight -= 1
            gauge.dec()
            job.done(attempt, ending, outcome)
