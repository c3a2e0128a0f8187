"""What the simulator's handlers (generate.py, endpoints.py, apis.py) read of the replica
they serve. ``SimReplica`` (server.py) is one; the handlers name this protocol instead, so
they do not import the server module that builds them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from loadtest.sim.config import SimConfig
from loadtest.sim.engine import Engine
from loadtest.sim.faults import Faults
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.nixl import NixlConnector
from loadtest.sim.stream import Streamer
from loadtest.sim.tokens import Words
from router.prompt import Renderer


class Host(Protocol):
    config: SimConfig
    engine: Engine
    faults: Faults
    metrics: SimMetrics
    streamer: Streamer
    created: int  # the model cards' creation time
    health_status: int  # what /health answers (a test hook)
    nixl: NixlConnector | None  # the KV connector, for disaggregated serving

    @property
    def renderer(self) -> Renderer: ...

    @property
    def words(self) -> Words: ...

    def resolve_model(self, body: dict[str, Any]) -> tuple[str, str | None]:
        """(served model, LoRA adapter or None) for a body; a 404 for an unknown model."""
        ...

    def render_chat(self, body: dict[str, Any]) -> list[int]: ...

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def check_ids(self, ids: Sequence[int], param: str) -> None: ...

    def reset_cache(self) -> None: ...

    def add_adapter(self, name: str) -> None:
        """Serve LoRA adapter ``name`` from now on (runtime loading)."""
        ...
