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

    def get(self) -> float:
        if not self._value:
            return 0.0
        return self._value * math.exp(-self.decay * max(0.0, self.clock() - self._at))

    def observe(self, seconds: float) -> None:
        now = self.get()
        self._value = now + self.alpha * (seconds - now) if now else seconds
        self._at = self.clock()
