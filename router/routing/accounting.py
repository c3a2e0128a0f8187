"""A request's load on the replica it was sent to, written once for every path out.

    charge    in flight, pending (a request and its prefill tokens) and the gauge, up
    prefilled its first byte: the pending counts down (once)
    release   whatever is still up, down

The routed exchange (router/routing/exchange.py) and the forwarder's jobs (router/routing/forwarder.py:
forwarded endpoints, /tokenize, a stored response's calls) both account through these, so no
path out of a request can leave a count behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.fleet.replicas import Replica
from router.schedule import Decision
from router.telemetry.metrics import Metrics


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of one request at one replica, and what it added to the replica's load."""

    replica: Replica
    decision: Decision | None = None  # the routing decision, for the routed endpoints
    prefill_tokens: int = 0  # prompt tokens the replica must compute (pending until 1st byte)
    pending: bool = False  # sent, its first byte not yet in
    charged: bool = False  # counted in flight (``charge``) and not yet released

    def set_prefill_tokens(self, tokens: int) -> None:
        """A better count of the prompt tokens the replica computes (a lazy head's exact
        count, once its rest is tokenized): the pending prefill follows while pending."""
        if self.pending:
            self.replica.pending_prefill_tokens += tokens - self.prefill_tokens
            self.prefill_tokens = tokens


def charge(metrics: Metrics, attempt: Attempt) -> None:
    """The attempt is on its way: in flight and pending on its replica. Raises nothing, so
    the caller's ``try`` (whose ``finally`` calls ``release``) may start right after it."""
    replica = attempt.replica
    replica.inflight += 1
    replica.pending_requests += 1
    replica.pending_prefill_tokens += attempt.prefill_tokens
    attempt.pending = True
    attempt.charged = True
    metrics.child(metrics.inflight, replica.url).inc()


def prefilled(attempt: Attempt) -> bool:
    """Its first byte came (its prefill is done): no longer pending. True the first time."""
    if not attempt.pending:
        return False
    attempt.pending = False
    replica = attempt.replica
    replica.pending_requests -= 1
    replica.pending_prefill_tokens -= attempt.prefill_tokens
    return True


def release(metrics: Metrics, attempt: Attempt) -> None:
    """The attempt ended, however it ended: every count ``charge`` raised, down (once)."""
    prefilled(attempt)
    if attempt.charged:
        attempt.charged = False
        attempt.replica.inflight -= 1
        metrics.child(metrics.inflight, attempt.replica.url).dec()
