"""The ``prefix-router`` subcommands the load-test tools add: ``demo``, ``replica`` and
``loadtest``.

The gateway (``router``) never imports this package; ``router.cli`` finds these objects
through the ``prefix_router.commands`` entry-point group declared in pyproject.toml. Each is a
:class:`Command`: a ``help`` line for ``prefix-router --help``, and a call that takes the
subcommand's own argv and returns an exit status (each parses its own flags, so the nested
``loadtest run|compare|sim`` parsers and every flag stay as they were).

Importing this module is cheap: a command's module (and matplotlib, tqdm, ...) is imported
only when that command runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence

EXTRA_HINT = "pip install '.[loadtest]' (in a prefix-router checkout)"


class Command:
    """A subcommand run by ``module.main(argv)``; ``requires`` are the top-level modules it
    needs beyond the gateway's own dependencies (the ``loadtest`` extra)."""

    def __init__(self, name: str, help: str, module: str, requires: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.module = module
        self.requires = tuple(requires)

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]

    def __call__(self, argv: Sequence[str]) -> int:
        missing = self.missing()
        if missing:
            print(
                f"prefix-router {self.name} needs {', '.join(missing)} (the loadtest extra): "
                f"{EXTRA_HINT}",
                file=sys.stderr,
            )
            return 2
        main = importlib.import_module(self.module).main
        return int(main(list(argv)) or 0)

    def __repr__(self) -> str:
        return f"Command({self.name!r}, module={self.module!r})"


demo = Command(
    "demo",
    "simulated replicas + the gateway vs round robin, on loopback",
    "loadtest.demo",
    requires=("numpy", "tqdm"),
)
# The simulator needs only the gateway's dependencies, so it runs in the gateway image too
# (deploy/compose/compose.sim.yaml).
replica = Command("replica", "run simulated vLLM replicas (no GPU)", "loadtest.replica")
loadtest = Command(
    "loadtest",
    "load-test replica affinity and write a report",
    "loadtest.cli",
    requires=("numpy", "tqdm", "matplotlib"),
)
