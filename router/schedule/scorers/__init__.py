"""Scorers: weighted cost terms, lower is better. Each module registers one by name."""

from router.schedule.scorers import inflight, kv_pressure, queued_tokens, uncached_prefill

__all__ = ["inflight", "kv_pressure", "queued_tokens", "uncached_prefill"]
