"""The time to first byte a gateway observes per replica: a decayed mean, model-free.

It sees what the token counts cannot: decode load sharing the replica's steps, a slow GPU, a
queue another gateway filled. Each observation moves the mean by ``alpha``; between
observations it decays toward 0 (half-life ``half_life_s``), so a replica nobody has sent to
lately is not marked slow forever.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Only requests the gateway predicted to prefill at most this many tokens are observed: their
# time to first byte is the replica's wait, not their own prefill (a first-contact miss of a
# long system prompt takes seconds on an idle replica and would mark it slow).
MAX_UNCACHED_TOKENS = 1024


def is_wait_sample(stream: bool, status: int, uncached_tokens: int) -> bool:
    """Whether an answer's time to first byte measures the replica's wait: a streamed
    success (a whole answer's time is not a time to first token) of a mostly cached prompt."""
    return stream and status < 400 and uncached_tokens <= MAX_UNCACHED_TOKENS


class ObservedTTFT:
    def __init__(
        self,
        alpha: float = 0.2,
        half_life_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alpha = alpha
        self.decay = math.log(2) / half_life_s
        self.clock = clock
        self._value = 0.0
        self._at = 0.0
        self.samples = 0

    def get(self) -> float:
        if not self._value:
            return 0.0
        return self._value * math.exp(-self.decay * max(0.0, self.clock() - self._at))

    def observe(self, seconds: float) -> None:
        now = self.get()
        self._value = now + self.alpha * (seconds - now) if now else seconds
        self._at = self.clock()
        self.samples += 1
