"""Drift watch: is a model's prediction running above what its replicas report?

Each answered request with a reported ``cached_tokens`` adds (predicted, reported). Over the
last ``window`` such requests with a prediction, the share of predicted tokens the replicas did
not confirm is the drift; above ``threshold`` with at least ``min_samples`` it is flagged (a
different chat template on the replicas, a tokenizer that is not theirs, a wrong block size).
Under-prediction is not drift: a replica may hold more than the gateway knows (another
gateway's traffic, generated tokens). One log line when it starts and one when it ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class DriftWatch:
    window: int = 50
    min_samples: int = 20
    threshold: float = 0.2
    samples: deque[tuple[int, int]] = field(default_factory=deque)
    flagged: bool = False
    # Sums over ``samples``, kept as they change (integers: exact): the ratio is read twice a
    # request, and summing 50 samples each time cost ~0.1M instructions.
    predicted: int = 0
    unconfirmed: int = 0

    def observe(self, predicted: int, reported: int) -> bool | None:
        """Add one request; returns the new flag when it changed, else None."""
        if predicted <= 0:
            return None
        self.samples.append((predicted, reported))
        self.predicted += predicted
        self.unconfirmed += max(0, predicted - reported)
        while len(self.samples) > self.window:
            p, r = self.samples.popleft()
            self.predicted -= p
            self.unconfirmed -= max(0, p - r)
        now = len(self.samples) >= self.min_samples and self.ratio() > self.threshold
        if now != self.flagged:
            self.flagged = now
            return now
        return None

    def ratio(self) -> float:
        """Predicted tokens not confirmed, over predicted tokens (0 when nothing is known)."""
        return self.unconfirmed / self.predicted if self.predicted else 0.0

    def state(self) -> dict[str, object]:
        return {
            "drifting": self.flagged,
            "unconfirmed_share": round(self.ratio(), 4),
            "samples": len(self.samples),
        }
