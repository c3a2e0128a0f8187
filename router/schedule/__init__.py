"""Scheduling: candidates -> filters -> scorers -> picker, as named plugins.

``registry`` registers plugins and policies by name; ``policies`` composes the named policies;
``spec`` reads the config's ``schedule:``. Importing this package registers every plugin.
"""

from router.schedule import filters, pickers, registry, scorers  # noqa: F401 (plugins register)
from router.schedule.pipeline import Pipeline
from router.schedule.policies import POLICIES
from router.schedule.registry import (
    DEFAULT_POLICY,
    PluginSpec,
    ProfileSpec,
    build,
    build_named,
    policy_names,
)
from router.schedule.ring import HashRing, Rings
from router.schedule.spec import check_config, from_config
from router.schedule.types import (
    Branch,
    Candidate,
    Decision,
    Pick,
    ScheduleError,
    ScoredCandidate,
    SpillCause,
)

__all__ = [
    "POLICIES",
    "Branch",
    "Candidate",
    "Decision",
    "HashRing",
    "Pick",
    "Pipeline",
    "PluginSpec",
    "ProfileSpec",
    "Rings",
    "ScheduleError",
    "ScoredCandidate",
    "SpillCause",
    "build",
    "build_named",
    "check_config",
    "from_config",
    "policy_names",
    "DEFAULT_POLICY",
    "registry",
]
