"""A routed request on the forwarding path (router/forwarding.py): the replica is the
policy's decision, the prompt's blocks are recorded for it as it is sent, a failure before
the first byte takes them back, and the answer is learnt from. Chat, completions, Messages
and Responses all go this way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from router.config import Config
from router.fleet import Fleet
from router.flow.ticket import Ticket
from router.forward import STREAM_ERROR_SHAPES, Outcome
from router.forwarding import Attempt, Ending, Job, queued_everywhere
from router.metrics import Metrics
from router.request import Endpoint, RoutedRequest
from router.request_path import RequestPath

log = logging.getLogger("prefix_router")

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


def why_label(why: str) -> str:
    """A failure's kind for a metric label: ``bad response: <parser text>`` -> ``bad response``,
    so label values stay a small, fixed set."""
    return why.split(":", 1)[0][:40]


def replica_name(fleet: Fleet, url: str, auth: bool) -> str:
    """A replica as a client may see it: its URL with auth off, else ``replica-<n>`` (its
    place in the replica list), so tenants learn no internal addresses."""
    if not auth:
        return url
    for n, known in enumerate(fleet.replicas):
        if known == url:
            return f"replica-{n}"
    return "replica"


class RoutedJob(Job):
    """One prepared request (``RequestPath.prepare``), sent where the policy decides."""

    def __init__(
        self,
        path: RequestPath,
        rr: RoutedRequest,
        headers: Mapping[str, str],
        config: Config,
        ticket: Ticket,
    ) -> None:
        super().__init__(PATHS[rr.endpoint], rr.forwarded_body(), headers)
        self.stream_error = STREAM_ERROR_SHAPES[rr.endpoint]
        self.rr = rr
        self.request_path = path
        self.metrics: Metrics = path.metrics
        # Which replica answered is for operators: off by default when tenants are
        # separated, and never its URL for a tenant (replica_name).
        self.decision_headers = (
            config.routing.decision_headers
            if config.routing.decision_headers is not None
            else not config.auth.enabled
        )
        self.auth = config.auth.enabled
        self.fleet: Fleet = path.wiring.fleet
        self.ticket = ticket  # flow control's (router/flow/): released by the caller
        self._sent_at = 0.0
        self._uncached = 0

    async def pick(self, fleet: Fleet, tried: frozenset[str]) -> Attempt | None:
        decision = await self.request_path.decide(self.rr, tried, self.ticket.replica)
        rr = self.rr
        attempt = Attempt(fleet.replicas[decision.replica], decision)
        attempt.prefill_tokens = max(0, rr.num_tokens - decision.matched_blocks * rr.block_size)
        self.ticket.decided(
            attempt.replica.url,
            attempt.prefill_tokens + rr.batch_tokens,  # a batch's others are prefilled too
            self.request_path.flow.expected_output(rr.max_tokens, rr.sequences),
        )
        if (tail := rr.tail) is not None and tail.full is None:

            def exact_count(full: RoutedRequest) -> None:
                """A lazy head counted its tail's estimate: the exact count, once known."""
                exact = max(0, full.num_tokens - decision.matched_blocks * full.block_size)
                attempt.set_prefill_tokens(exact)

            tail.on_full.append(exact_count)
        return attempt

    def saturated(self, fleet: Fleet, tried: frozenset[str]) -> bool:
        """Flow control holds requests of its (base) model or has no free prefill slot, or
        every other replica serving it has a queue of its own."""
        path = self.request_path
        model = path.flow_model(self.rr)
        if path.flow.saturated(model):
            return True
        return queued_everywhere(r for r in fleet.serving(model) if r.url not in tried)

    def extra_headers(self, attempt: Attempt) -> dict[str, str]:
        ticket = self.ticket
        extra = dict(ticket.headers)  # flow control's rate-limit headers
        if not self.decision_headers:
            return extra
        assert attempt.decision is not None
        extra["x-prefix-router-replica"] = replica_name(self.fleet, attempt.replica.url, self.auth)
        extra["x-prefix-router-cached-blocks"] = str(attempt.decision.matched_blocks)
        if ticket.why:
            extra["x-prefix-router-queued-ms"] = f"{ticket.queued_s * 1000:.0f}"
        return extra

    def headers_timeout(self, attempt: Attempt) -> float | None:
        rr = self.rr
        tokens = rr.max_tokens
        if tokens is not None:
            tokens *= rr.sequences  # completion_tokens counts every choice of every prompt
        return self.fleet.first_byte_timeout(attempt.replica, rr.stream, tokens)

    def on_sent(self, attempt: Attempt) -> Callable[[], Awaitable[None]]:
        assert attempt.decision is not None
        decision = attempt.decision
        return lambda: self.request_path.record_placement(self.rr, decision)

    async def before_proxy(self, attempt: Attempt) -> None:
        await self.request_path.upkeep.ensure_adapter(
            self.rr, attempt.replica
        )  # a LoRA at run time

    def before_send(self, attempt: Attempt) -> None:
        assert attempt.decision is not None
        self.request_path.policy.placed(attempt.decision)
        self._sent_at = time.perf_counter()
        self._uncached = attempt.prefill_tokens
        # When its prefill slot frees: after every prompt of a batch.
        self.ticket.sent(attempt.prefill_tokens + self.rr.batch_tokens, self.rr.stream)

    def first_byte(self, attempt: Attempt) -> None:
        assert attempt.decision is not None
        if self.rr.stream:
            self.ticket.observed(self._uncached, time.perf_counter() - self._sent_at)
        self.ticket.first_byte()  # flow control: the replica's prefill slot is free
        self.request_path.policy.first_byte(attempt.decision)

    async def unavailable(self, attempt: Attempt, why: str) -> None:
        assert attempt.decision is not None
        decision = attempt.decision
        await self.request_path.forget_unsent(self.rr, decision)
        self.metrics.retries.labels(decision.replica, why_label(why)).inc()
        self.metrics.requests.labels(decision.replica, decision.policy, "unavailable").inc()

    async def answered(self, attempt: Attempt, outcome: Outcome) -> None:
        assert attempt.decision is not None
        await self.fleet.record_response(
            attempt.replica,
            outcome.status,
            stream=self.rr.stream,
            first_byte_s=outcome.first_byte_s,
            completion_tokens=outcome.completion_tokens,
        )
        if self.rr.endpoint == "responses" and self.ticket.session:
            self.request_path.response_chains.learn(outcome.head, self.ticket.session)
        # After the response is written (the next loop turn, before any new request).
        asyncio.get_running_loop().call_soon(
            self.request_path.learn, self.rr, attempt.decision, outcome
        )

    def done(self, attempt: Attempt, ending: Ending, outcome: Outcome | None) -> None:
        assert attempt.decision is not None
        if ending is Ending.CLIENT_GONE:
            self.metrics.client_disconnects.inc()
            self.metrics.requests.labels(
                attempt.replica.url, attempt.decision.policy, "client_gone"
            ).inc()
        self.request_path.policy.done(attempt.decision, outcome.status if outcome else None)
