"""This gateway's requests in prefill, and whether anyone else is waiting to be treated fairly.

A released request holds its place from its release to its first byte (or its end): counted
per model and replica (``None``: released, not placed yet), with the prompt tokens it will
prefill there. ``Contention`` says whether more than one tenant sent a model requests lately:
while one tenant is alone there is nobody to be fair to, so the gate opens as far as vLLM's
own step would (``saturation.capacity``), and the fleet serves it as it would without flow
control.
"""

from __future__ import annotations

from collections.abc import Mapping


class Reservations:
    def __init__(self) -> None:
        # model -> replica (None: not placed yet) -> (requests, their uncached prompt tokens)
        self._count: dict[str, dict[str | None, int]] = {}
        self._tokens: dict[str, dict[str | None, int]] = {}

    def take(self, model: str, replica: str | None, tokens: int) -> None:
        count = self._count.setdefault(model, {})
        count[replica] = count.get(replica, 0) + 1
        held = self._tokens.setdefault(model, {})
        held[replica] = held.get(replica, 0) + tokens

    def give_back(self, model: str, replica: str | None, tokens: int) -> None:
        count, held = self._count[model], self._tokens[model]
        count[replica] -= 1
        held[replica] -= tokens
        if not count[replica]:
            del count[replica], held[replica]

    def move(self, model: str, old: str | None, new: str, old_tokens: int, tokens: int) -> None:
        """Placed: its place moves to ``new``, with the tokens it will prefill there."""
        self.give_back(model, old, old_tokens)
        self.take(model, new, tokens)

    def count(self, model: str) -> Mapping[str | None, int]:
        return self._count.get(model, {})

    def tokens(self, model: str) -> Mapping[str | None, int]:
        return self._tokens.get(model, {})

    def total(self, model: str) -> int:
        return sum(self._count.get(model, {}).values())

    def by_replica(self) -> dict[str | None, int]:
        """Requests in prefill per replica, every model's."""
        out: dict[str | None, int] = {}
        for count in self._count.values():
            for replica, n in count.items():
                out[replica] = out.get(replica, 0) + n
        return out


class Contention:
    """Whether more than one tenant sends a model requests: contended for ``window_s`` after
    a request whose tenant is not the previous request's. O(1) per request."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, str] = {}  # model -> the tenant seen last
        self._until: dict[str, float] = {}  # model -> contended until then

    def seen(self, model: str, tenant: str, now: float) -> None:
        last = self._last.get(model)
        if last != tenant:
            if last is not None:
                self._until[model] = now + self.window_s
            self._last[model] = tenant

    def alone(self, model: str, now: float) -> bool:
        return now >= self._until.get(model, 0.0)
