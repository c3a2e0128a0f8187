"""Filters: who may not take a request. Each module registers one by name."""

from router.schedule.filters import load_bound, recent_share

__all__ = ["load_bound", "recent_share"]
