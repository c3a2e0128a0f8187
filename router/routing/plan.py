"""A routing decision as a plan of legs: what the exchange (router/routing/exchange.py) sends, in
order. Today's aggregated routing is a one-leg plan (role ``both``); prefill/decode
disaggregation is a ``prefill`` leg followed by a ``decode`` leg, which reads the earlier
leg's outcome (its KV transfer parameters) -- no special case in the exchange, which loops
over the legs and re-plans when one fails before its first byte.
"""

from __future__ import annotations

from router.core.record import record
from router.fleet.replicas import Replica, Role
from router.schedule import Decision


@record
class Leg:
    """One request to one replica, as planned (read-only: the exchange holds what
    changes while it is sent, router/routing/accounting.py's ``Attempt``)."""

    role: Role
    replica: Replica
    decision: Decision  # the scheduler's, for this leg's role (``matched_blocks``, why)
    prefill_tokens: int  # prompt tokens the replica is predicted to compute


@record
class Plan:
    """The legs of one routed request, in the order they are sent."""

    legs: tuple[Leg, ...]
    # In a disaggregated fleet, why the request has no prefill leg (router/disagg/decision.py;
    # None: it has one, or the fleet does not disaggregate).
    skipped: str | None = None
    # Prefill-first order: the decode leg's replica is chosen again once the prefill answered.
    decode_after_prefill: bool = False

    @property
    def last(self) -> Leg:
        """The leg whose answer the client gets."""
        return self.legs[-1]
