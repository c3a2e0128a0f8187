"""Retries before the first byte as a budget, as Envoy's retry budgets are: at most
``percent`` of the requests in flight may be on a retry at once, and never fewer than
``min_concurrency`` (so a quiet gateway can still retry). A retry past the budget is not
sent: under overload most failures are timeouts of requests that sat in a replica's queue,
and re-sending them to another full replica doubles the work (a retry storm) rather than
serving anyone sooner."""

from __future__ import annotations

import math


class RetryBudget:
    """The gateway's requests in flight and those of them on a retry."""

    def __init__(self, percent: float, min_concurrency: int) -> None:
        self.percent = percent
        self.min_concurrency = min_concurrency
        self.active = 0  # requests on the forwarding path now
        self.retrying = 0  # of them, those that have been re-sent (counted once each)

    def limit(self) -> int:
        return max(self.min_concurrency, math.floor(self.active * self.percent / 100))

    def take(self) -> bool:
        """One more request may go on a retry (give it back with ``give_back``)."""
        if self.retrying >= self.limit():
            return False
        self.retrying += 1
        return True

    def give_back(self) -> None:
        self.retrying -= 1
