"""Readiness, defined once: when a gateway can route exactly, and what it waits for if not.

Ready means: the gateway is not draining, and at least one healthy replica has answered
``/v1/models`` with every base model it lists in the registry and settled: its tokenizer
loaded (exact), or declared absent (no tokenizer anywhere: the labelled text-prefix
fallback). A model whose tokenizer is still loading, or failed to load and is being retried
(router/models/upkeep.py), is not settled; nor is a loaded one whose first parity probe
(router/models/parity.py) has not answered yet. ``/ready``, the "gateway ready" line
(router/http/startup.py) and whatever else asks whether a gateway can take traffic read
``assess``; nothing else decides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.fleet.replicas import Fleet, Replica
from router.models.registry import ModelEntry


@dataclass(frozen=True)
class Readiness:
    ready: bool
    waiting_for: str | None  # in words, None when ready (names replicas and errors: detail)
    draining: bool
    replicas: int
    healthy: int
    models_answered: int  # healthy replicas whose /v1/models has answered
    models: Mapping[str, ModelEntry] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        """What anyone may read: status and counts, no names, paths or errors."""
        states = [e.state for e in self.models.values()]
        return {
            "ready": self.ready,
            "draining": self.draining,
            "replicas": self.replicas,
            "healthy_replicas": self.healthy,
            "models_known_replicas": self.models_answered,
            "model_count": len(states),
            "models_settled": sum(1 for s in states if s in ("loaded", "fallback")),
        }

    def detail(self) -> dict[str, Any]:
        """For the operator: what it waits for and each model's state."""
        return {
            **self.counts(),
            "waiting_for": self.waiting_for,
            "models": {
                name: {
                    "basis": e.basis,
                    "tokenizer_state": e.state,
                    "replicas": len(e.replicas),
                    "kept_apart": len(e.apart),
                    "block_size": e.block_size,
                    "drifting": e.drift.flagged,
                    "parity": e.parity,
                    **({"parity_detail": e.parity_detail} if e.parity_detail else {}),
                    **({"missing_tokenizer": e.missing} if e.missing else {}),
                }
                for name, e in sorted(self.models.items())
            },
        }


def assess(fleet: Fleet, entries: Mapping[str, ModelEntry], draining: bool) -> Readiness:
    """The gateway's readiness now (cheap: a pass over replicas and their models)."""
    replicas = list(fleet.replicas.values())
    healthy = [r for r in replicas if r.healthy]
    answered = [r for r in healthy if r.models_known]
    waiting: str | None = None
    if draining:
        waiting = "the gateway is shutting down"
    elif not replicas:
        waiting = "a replica: none configured or discovered yet"
    elif not healthy:
        waiting = "a replica to pass its health check (" + "; ".join(map(_state, replicas)) + ")"
    elif not answered:
        waiting = (
            "a healthy replica to answer /v1/models (" + ", ".join(r.url for r in healthy) + ")"
        )
    elif not any(_settled(r, entries) for r in answered):
        waiting = (
            "the tokenizers of the models the replicas serve ("
            + "; ".join(_unsettled(answered, entries))
            + ")"
        )
    return Readiness(
        ready=waiting is None,
        waiting_for=waiting,
        draining=draining,
        replicas=len(replicas),
        healthy=len(healthy),
        models_answered=len(answered),
        models=dict(entries),
    )


def _settled(r: Replica, entries: Mapping[str, ModelEntry]) -> bool:
    for model, parent in r.models.items():
        if parent is None:
            entry = entries.get(model)
            if entry is None or not entry.loaded or _probing(entry):
                return False
    return True


def _probing(entry: ModelEntry) -> bool:
    return entry.renderer is not None and entry.parity == "pending"


def _unsettled(replicas: list[Replica], entries: Mapping[str, ModelEntry]) -> list[str]:
    out: dict[str, str] = {}
    for r in replicas:
        for model, parent in r.models.items():
            if parent is not None or model in out:
                continue
            entry = entries.get(model)
            if entry is None:
                out[model] = f"{model}: not in the registry yet"
            elif entry.state == "failed":
                out[model] = f"{model}: failed to load, retrying ({entry.missing})"
            elif entry.state == "pending":
                out[model] = f"{model}: loading"
            elif _probing(entry):
                out[model] = f"{model}: its parity probe"
    return list(out.values())


def _state(r: Replica) -> str:
    if r.ejected:
        return f"{r.url}: ejected ({r.ejection_reason})"
    return f"{r.url}: {r.health_error or 'not checked yet'}"
