"""Multi-model fleets: a registry of the served models (router/models/registry.py), where their
tokenizers come from (tokenizers.py), their block sizes (blocksize.py), the text-prefix
fallback for a model without a tokenizer (fallback.py) and the drift watch (drift.py)."""

from router.models.blocksize import BlockSizeRefused
from router.models.drift import DriftWatch
from router.models.registry import ModelEntry, ModelRegistry, Route
from router.models.spec import ModelSpec, ModelSpecError, parse_models

__all__ = [
    "BlockSizeRefused",
    "DriftWatch",
    "ModelEntry",
    "ModelRegistry",
    "ModelSpec",
    "ModelSpecError",
    "Route",
    "parse_models",
]
