"""Passive health: what the gateway's own requests say about a replica.

An ``ErrorWindow`` counts a replica's recent outcomes (5xx, timeouts and connection failures
are errors; a 4xx is the client's fault). A ``LatencyEstimate`` tracks how long the replica
takes to answer, so a replica that accepts a request and never answers is given up on after a
multiple of what it (or, before it has answered enough, the fleet) usually takes, not after
the configured ceiling. ``Fleet`` (router/fleet/replicas.py) applies the ejection policy.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MIN_SAMPLES = 5  # answers before an estimate is trusted
# Token counts beyond this are not believed (a replica's usage can say anything): a bigger
# int does not convert to float and raised OverflowError on the request path.
MAX_TOKENS = 2**40


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """When to eject a replica, and for how long (Envoy's outlier detection, simplified)."""

    window_s: float = 10.0  # outcomes older than this are forgotten
    min_requests: int = 10  # fewer outcomes in the window never eject on the ratio
    error_ratio: float = 0.5  # eject when errors / outcomes exceeds this
    consecutive_failures: int = 3  # ... or after this many failures in a row
    base_ejection_s: float = 5.0  # ejection n lasts n x base (n = recent ejections) ...
    max_ejection_s: float = 300.0  # ... up to this
    max_ejected_percent: float = 50.0  # at most this share of the fleet is ejected at once
    decay_s: float = 30.0  # in rotation this long: one recent ejection is forgiven

    def ejection_s(self, ejections: int) -> float:
        return min(self.max_ejection_s, self.base_ejection_s * max(1, ejections))

    def max_ejected(self, replicas: int) -> int:
        """Replicas outlier detection may hold out at once: the percentage of the fleet,
        rounded down, but one in a fleet of two or more (else a fleet of three at 30% could
        never eject anything; 0% disables ejection); the caller also keeps one replica in
        rotation."""
        if replicas < 2 or self.max_ejected_percent <= 0:
            return 0
        return max(1, math.floor(replicas * self.max_ejected_percent / 100.0))


class ErrorWindow:
    """(outcomes, errors) of the last ``window_s`` seconds, in buckets of a tenth of it."""

    __slots__ = ("window_s", "_bucket_s", "_buckets")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._bucket_s = window_s / 10
        self._buckets: deque[list[float]] = deque()  # [start, outcomes, errors]

    def add(self, now: float, error: bool) -> None:
        b = self._buckets
        if not b or now >= b[-1][0] + self._bucket_s:
            b.append([now, 0, 0])
        b[-1][1] += 1
        if error:
            b[-1][2] += 1

    def counts(self, now: float) -> tuple[int, int]:
        b = self._buckets
        while b and b[0][0] + self._bucket_s <= now - self.window_s:
            b.popleft()
        return int(sum(x[1] for x in b)), int(sum(x[2] for x in b))

    def clear(self) -> None:
        self._buckets.clear()


class LatencyEstimate:
    """A smoothed mean and mean deviation (TCP's RTT estimator, RFC 6298); ``high`` is the
    mean plus four deviations, a cheap stand-in for a p99 that needs no sorting per request."""

    __slots__ = ("n", "mean", "dev")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.dev = 0.0

    def add(self, x: float) -> None:
        if not (x >= 0 and math.isfinite(x)):
            return
        if self.n == 0:
            self.mean, self.dev = x, x / 2
        else:
            self.dev = 0.75 * self.dev + 0.25 * abs(x - self.mean)
            self.mean = 0.875 * self.mean + 0.125 * x
        self.n += 1

    def high(self) -> float | None:
        return self.mean + 4 * self.dev if self.n >= MIN_SAMPLES else None


@dataclass
class Latency:
    """A replica's (or the fleet's) answer times, by what bounds the wait for headers."""

    # Streams: vLLM sends headers before prefill, so the time to the first chunk (what
    # ``Outcome.first_byte_s`` measures) bounds the time to headers from above.
    stream_first_byte: LatencyEstimate
    # Non-streaming answers come whole, after the last token: seconds per generated token
    # (prefill and queueing folded in), scaled by the request's max_tokens.
    seconds_per_token: LatencyEstimate

    @classmethod
    def new(cls) -> Latency:
        return cls(LatencyEstimate(), LatencyEstimate())

    def observe(self, stream: bool, first_byte_s: float, completion_tokens: int | None) -> None:
        if stream:
            self.stream_first_byte.add(first_byte_s)
        elif completion_tokens is not None and 0 <= completion_tokens <= MAX_TOKENS:
            self.seconds_per_token.add(first_byte_s / (completion_tokens + 1))

    def expected(self, stream: bool, tokens: int | None) -> float | None:
        """A generous estimate of the time to headers, or None when nothing is known."""
        if stream:
            return self.stream_first_byte.high()
        if tokens is None:
            return None  # unbounded output: only the configured ceiling is safe
        per_token = self.seconds_per_token.high()
        return None if per_token is None else per_token * (min(tokens, MAX_TOKENS) + 1)
