"""A simulated vLLM replica: vLLM's OpenAI-compatible HTTP surface, its prefix cache and a
timing model, without a GPU.

Used by the tests, the demo and the load-test harness as the ground truth the router is judged
against, so the prefix cache (``loadtest.sim.kvcache``) is written independently of
``router.core.blocks`` and follows vLLM's rules exactly; see ``loadtest.sim.engine`` for the
scheduling and timing model.

    async with run_replicas(3, block_size=16) as replicas:
        urls = [r.url for r in replicas]

    python -m loadtest.replica --port 9001 --count 3

This module is the public face; the parts live in ``loadtest.sim``: ``config`` (SimConfig),
``server`` (SimReplica, run_replicas), ``generate`` and ``stream`` (the generation endpoints),
``endpoints`` (the others), ``protocol`` (request fields and response shapes), ``faults``,
``tokens`` (shared tokenizers), ``engine``, ``kvcache``, ``metrics`` and ``cli``.
"""

from __future__ import annotations

import sys

from loadtest.sim.cli import build_parser, config_from_args, main
from loadtest.sim.config import DEFAULT_TOKENIZER, VLLM_VERSION, SimConfig
from loadtest.sim.server import SimReplica, run_replicas
from loadtest.sim.tokens import get_renderer, hash_seed

__all__ = [
    "SimConfig",
    "SimReplica",
    "run_replicas",
    "get_renderer",
    "main",
    "DEFAULT_TOKENIZER",
    "VLLM_VERSION",
    "build_parser",
    "config_from_args",
    "hash_seed",
]

if __name__ == "__main__":
    sys.exit(main())
