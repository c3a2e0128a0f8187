"""Routing policies: candidates -> filters -> cost -> pick. Built by name from config."""

from router.schedule.policies import (
    POLICIES,
    Candidate,
    Decision,
    Policy,
    ScoredCandidate,
    build_policy,
)
from router.schedule.ring import HashRing

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "HashRing",
    "Policy",
    "ScoredCandidate",
    "build_policy",
]
