"""What flow control reads of a request (``FlowRequest``), and what the scheduler says of it
before it is queued (``Estimate``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.flow.settings import FlowSettings


@dataclass(slots=True)
class FlowRequest:
    """What flow control needs of a request."""

    model: str
    tenant: str
    session: str
    settings: FlowSettings
    prompt_tokens: int  # of the prompt it routes on
    max_tokens: int | None  # per sequence
    stream: bool
    batch_tokens: int = 0  # a completions batch's other prompts
    sequences: int = 1  # n per prompt, every prompt of a batch

    def output_tokens(self, default: int) -> int:
        """The output it may generate in all: every sequence's ``max_tokens``."""
        per = self.max_tokens if self.max_tokens is not None else default
        return per * self.sequences


# The scheduler's choice for a request among the given replicas, while nobody holds its
# prefix (``Capacity.best_unheld``): the picker's rule, so the slot is where it would go.
Place = Callable[[list[str]], str]
# What the scheduler says of a request before it is queued: prompt tokens the best-placed
# replica would prefill, the replicas holding that much, and (none holding it) its ``Place``.
Estimate = tuple[int, tuple[str, ...], Place | None]
