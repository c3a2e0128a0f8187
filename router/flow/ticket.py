"""A request admitted by flow control, and the 429 a shed one gets.

The ticket holds one prefill slot of its model from its release to its first byte (or its
end); the request path tells it where the scheduler placed the request (``decided``), when it
was forwarded (``sent``) and when its first byte came (``first_byte``), and calls ``done``
however the request ended. It reaches the controller only through ``Slots``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Protocol

from router.core.errors import APIError


class Slots(Protocol):
    """What a ticket asks of the controller that admitted it."""

    prefill_tps: float  # prefill tokens/s streamed answers showed (0: none yet)

    def slot_decided(
        self, ticket: Ticket, replica: str, uncached: int, output_tokens: int
    ) -> None: ...

    def slot_free(self, model: str, replica: str | None, tokens: int) -> None: ...

    def learn_prefill(self, tps: float) -> None: ...


@dataclass(eq=False)
class Ticket:
    """A request admitted by flow control: holds one prefill slot of its model from release
    to its first byte (or its end). ``done`` is idempotent and always called."""

    controller: Slots | None
    model: str
    tenant: str
    band: str
    weight: float
    session: str = ""
    cost: float = 0.0
    queued_s: float = 0.0
    why: str = ""  # why it waited (empty: it did not)
    headers: dict[str, str] = field(default_factory=dict)  # rate-limit headers
    held: bool = False
    replica: str | None = None  # where its slot is reserved (None: not placed yet)
    tokens: int = 0  # the uncached prompt tokens it prefills there (estimated until placed)
    charged: bool = False  # its cost is already in the fair queue's accounting
    _timer: asyncio.TimerHandle | None = None

    def decided(self, replica: str, uncached_tokens: int, output_tokens: int) -> None:
        """The scheduler placed it on ``replica``: its slot is counted there, and the tenant
        is charged what it costs (if the queue did not already)."""
        if self.controller is not None:
            self.controller.slot_decided(self, replica, uncached_tokens, output_tokens)

    def sent(self, uncached_tokens: int, stream: bool) -> None:
        """Forwarded. A non-streamed answer's first byte comes after its whole decode: its
        slot is freed once its prefill should be over (at the prefill speed streamed answers
        showed), or at its first byte if that comes first."""
        c = self.controller
        if stream or not self.held or c is None or self._timer is not None or not c.prefill_tps:
            return
        seconds = 0.05 + uncached_tokens / c.prefill_tps
        self._timer = asyncio.get_running_loop().call_later(seconds, self.first_byte)

    def observed(self, uncached_tokens: int, first_byte_s: float) -> None:
        """A streamed first byte: teaches the prefill speed non-streamed requests use."""
        if self.controller is not None and uncached_tokens >= 256 and first_byte_s > 0:
            self.controller.learn_prefill(uncached_tokens / first_byte_s)

    def first_byte(self) -> None:
        if self.held and self.controller is not None:
            self.held = False
            self.controller.slot_free(self.model, self.replica, self.tokens)

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.first_byte()


def shed_error(
    status_message: str, code: str, retry_after: float, headers: dict[str, str]
) -> APIError:
    return APIError(
        429,
        status_message,
        code=code,
        headers={**headers, "Retry-After": str(max(1, math.ceil(retry_after)))},
    )


def too_large(tokens: int, tpm: int) -> APIError:
    """A request over its tenant's whole minute of tokens: it could never be admitted, so
    it is refused as such, without a Retry-After (waiting would not help). A 429 with
    ``rate_limit_exceeded``, as OpenAI answers a request larger than an organisation's
    TPM, so clients read it as they read that."""
    return APIError(
        429,
        f"Request too large: it needs up to {tokens} tokens (prompt + max_tokens x n) and "
        f"this tenant's limit is {tpm} tokens per minute, so it can never be admitted; "
        "reduce the prompt, max_tokens or n",
        code="rate_limit_exceeded",
        param="max_tokens",
    )
