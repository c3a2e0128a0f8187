"""Pickers: the one replica among the eligible. Each module registers one by name."""

from router.schedule.pickers import random_min, random_pick, ring_min_cost, ring_owner, round_robin

__all__ = ["random_min", "random_pick", "ring_min_cost", "ring_owner", "round_robin"]
