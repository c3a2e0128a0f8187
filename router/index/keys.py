"""Key names of a model's shared index: ``{namespace}:{<model>}:`` (one Redis Cluster slot per
model), and which model a replica's keys belong to."""

from __future__ import annotations

from collections.abc import Callable


def model_tag(model: str) -> str:
    """``model`` made safe inside a ``{...}`` hash tag: braces (and ``%``) are percent-encoded
    so the tag always spans the whole model name and is never empty."""
    if not model:
        raise ValueError("model must be non-empty")
    return model.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def key_prefix(namespace: str, model: str) -> str:
    """``{namespace}:{<model>}:``, the prefix of every key for ``model``."""
    if not namespace or "{" in namespace or "}" in namespace:
        raise ValueError("namespace must be non-empty and contain no braces")
    return f"{namespace}:{{{model_tag(model)}}}:"


class ModelKeys:
    """The key prefix of each replica's model: the model it reports serving (``model_of``),
    else the last one it reported (a replica removed from the fleet is still dropped under its
    model's keys), else ``model`` (not known yet)."""

    def __init__(
        self, namespace: str, model: str, model_of: Callable[[str], str | None] | None = None
    ) -> None:
        self.namespace = namespace
        self.model = model
        self.prefix = key_prefix(namespace, model)
        self.model_of = model_of
        self._models: dict[str, str] = {}  # replica -> the model it last reported
        self._prefixes: dict[str, str] = {}  # model -> its key prefix

    def prefix_of(self, replica: str) -> str:
        model = self.model_of(replica) if self.model_of is not None else None
        if model is None:
            model = self._models.get(replica)
            if model is None:
                return self.prefix
        else:
            self._models[replica] = model
        prefix = self._prefixes.get(model)
        if prefix is None:
            prefix = self._prefixes[model] = key_prefix(self.namespace, model)
        return prefix
