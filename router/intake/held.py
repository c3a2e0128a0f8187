"""Request bodies held in the gateway once they arrived: a budget per client and in all.

The in-flight body budget (router/http/handlers.py ``read_body``) counts bytes only while they
arrive. A request then stays in the gateway for as long as it waits in flow control's queue
(up to ``flow_queue_timeout_s``) and is forwarded, holding its decoded body: a 24 KB gzip body
decodes to up to ``max_body_bytes``. Each request is charged ``HELD_FACTOR`` times its decoded
size from the moment it is decoded until its answer ends, against ``max_held_body_bytes`` in
all and a client's share of it (``client_share``, the same client as the in-flight budget's);
past either it is refused at once, before it is parsed. A waiting request keeps one copy of
its body, the bytes it forwards (``slim``): the parsed object's large values are dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from router.core.errors import APIError
from router.intake.budget import SharedBudget
from router.intake.routed_request import RoutedRequest

# What one held request costs in RSS per decoded body byte, measured (docs/tenancy.md "Held
# request bodies"): the forwarded bytes (1x), and while it is being parsed and rendered the
# parsed values and the rendered prompt, freed once it waits (``slim``). Charged for the
# request's whole stay, so a burst of parses is covered too.
HELD_FACTOR = 2.0
SLIM_BYTES = 64 * 1024  # bodies below this keep their parsed object (slimming costs a walk)
_SMALL = 1024  # a top-level value of at most this many characters and values is kept


class Hold:
    """One request's charge, given back once (``release`` is idempotent)."""

    __slots__ = ("_budget", "_client", "_n")

    def __init__(self, budget: SharedBudget, client: str, n: int) -> None:
        self._budget, self._client, self._n = budget, client, n

    def release(self) -> None:
        n, self._n = self._n, 0
        self._budget.give_back(self._client, n)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HeldBytes:
    """The held-bytes budget of one gateway."""

    def __init__(self, total: int, share: int, on_refused: Callable[[str], None]) -> None:
        self.budget = SharedBudget(total, share)
        self._on_refused = on_refused  # "client_held_bytes" or "held_bytes"

    @property
    def held(self) -> int:
        return self.budget.held

    def hold(self, client: str, decoded_bytes: int) -> Hold:
        """Charge ``client`` for a body of ``decoded_bytes``: a 429 past its share (its own
        requests hold it: retry when they end), a 503 past the gateway's total."""
        n = math.ceil(decoded_bytes * HELD_FACTOR)
        refused = self.budget.take(client, n)
        if refused == "share":
            self._on_refused("client_held_bytes")
            raise APIError(
                429,
                f"this client's requests already hold {self.budget.held_by(client)} bytes of "
                f"request bodies in the gateway (its share is {self.budget.share}; this one "
                f"counts {n}); retry once some of them have been answered",
                code="held_bytes_exceeded",
                headers={"Retry-After": "1"},
            )
        if refused == "total":
            self._on_refused("held_bytes")
            raise APIError(
                503,
                "the gateway holds too many request bodies at once; retry shortly",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return Hold(self.budget, client, n)


def _small(value: Any) -> bool:
    """Whether ``value`` holds at most ``_SMALL`` characters and values (an early-exit walk:
    it costs at most that much, whatever the value's size)."""
    budget = _SMALL
    stack = [value]
    while stack:
        v = stack.pop()
        budget -= len(v) if type(v) is str else 1
        if budget < 0:
            return False
        if type(v) is dict:
            stack.extend(v.values())
            budget -= len(v)
        elif type(v) is list:
            stack.extend(v)
    return True


def _tool_names(tools: Any) -> list[dict[str, Any]] | None:
    if not isinstance(tools, list):
        return None
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        out.append(
            {"type": "function", "function": {"name": name if isinstance(name, str) else ""}}
        )
    return out


def waiting(rr: RoutedRequest) -> RoutedRequest:
    """``rr`` as it waits and is forwarded: one copy of its body, the bytes it forwards
    (``RoutedRequest.raw``), its parsed body ``slim``. Whoever calls it must not keep the
    original ``rr``: that would keep the whole parsed body alive."""
    if rr.raw is None or len(rr.raw) <= SLIM_BYTES:
        return rr
    return dataclasses.replace(rr, body=slim(rr.body))


def slim(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without its large top-level values, for a request whose forwarded bytes are
    made (``RoutedRequest.raw``): what is read of a request's body after it is prepared
    (``stream``, ``n``, ``store``, session ids, logprobs flags, tool names for diagnostics)
    is kept; the prompt and large extra fields live on in the forwarded bytes only."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if type(value) not in (str, list, dict) or _small(value):
            out[key] = value
        elif key == "tools":
            out[key] = _tool_names(value)
    return out
