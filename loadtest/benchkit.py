"""What the bench scripts share: one argument parser with the common flags, a subset of named
runs, the JSON rows file, progress lines, and tables (Markdown or fixed-width text) with
their percentage, millisecond and ratio cells.

A bench is ``p = benchkit.parser(__name__, __doc__, seed=0, json=True)``, its own flags,
``args = p.parse_args(argv)``; its table is ``benchkit.markdown(headers, rows)`` or
``benchkit.text(columns, rows)``, each ratio cell ``benchkit.ratio(value, baseline)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; the module doc's own line breaks kept."""


def parser(
    module: str,
    doc: str | None,
    *,
    seed: int | None = None,
    seed_help: str | None = None,
    seconds: tuple[float, str] | None = None,
    quick: str | None = None,
    json: bool = False,
    whole_doc: bool = False,
) -> argparse.ArgumentParser:
    """``python -m <module>``'s parser, described by the first paragraph of ``doc`` (all of it
    with ``whole_doc``), with the common flags asked for: ``--seed N``, ``--seconds S``
    (default, help), ``--quick`` (its help says what it shortens) and ``--json FILE``."""
    description = doc if whole_doc or not doc else doc.split("\n\n")[0]
    p = argparse.ArgumentParser(
        prog=f"python -m {module}", description=description, formatter_class=_Help
    )
    if seconds is not None:
        p.add_argument("--seconds", type=float, default=seconds[0], help=seconds[1])
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed, help=seed_help)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if json:
        p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p


def add_subset(
    p: argparse.ArgumentParser, flag: str, names: Sequence[str], default: str | None = None
) -> None:
    """``--<flag> a,b``: which of the named runs (mixes, scenarios...) to run."""
    p.add_argument(flag, default=default, help=f"comma-separated subset of {', '.join(names)}")


def subset(value: str | None, names: Sequence[str], what: str) -> list[str]:
    """The names ``value`` lists (all of ``names`` when empty); an unknown one exits with the
    choices."""
    chosen = value.split(",") if value else list(names)
    for name in chosen:
        if name not in names:
            raise SystemExit(f"unknown {what} {name!r}; choose from {', '.join(names)}")
    return chosen


def write_json(path: str | None, rows: Any) -> None:
    """``--json FILE``: the rows as JSON (values JSON lacks as their ``str``)."""
    if path:
        Path(path).write_text(json.dumps(rows, indent=2, default=str))


def progress(text: str) -> None:
    """A progress line on stderr (stdout keeps only the figures)."""
    print(text, file=sys.stderr, flush=True)


def markdown(headers: str | Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table, every cell as ``str``; ``headers`` a sequence or one string with the
    headers between ``|``."""
    if isinstance(headers, str):
        headers = [h.strip() for h in headers.strip().strip("|").split("|")]
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


class Text:
    """A fixed-width table printed as it goes: ``(header, width)`` per column, the first
    left-aligned and the others right-aligned (``(header, width, "<")`` to choose)."""

    def __init__(self, columns: Sequence[tuple[str, int] | tuple[str, int, str]]) -> None:
        self.columns: list[tuple[str, int, str]] = []
        for i, column in enumerate(columns):
            align = column[2] if len(column) == 3 else ("<" if i == 0 else ">")
            self.columns.append((column[0], column[1], align))

    def row(self, cells: Sequence[object]) -> str:
        return "".join(
            f"{str(c):{a}{w}}" for c, (_, w, a) in zip(cells, self.columns, strict=True)
        ).rstrip()

    def head(self) -> str:
        """The header and a rule under it."""
        head = self.row([h for h, _, _ in self.columns])
        return f"{head}\n{'-' * len(head)}"


def text(
    columns: Sequence[tuple[str, int] | tuple[str, int, str]], rows: Iterable[Sequence[object]]
) -> str:
    """A whole fixed-width table (``Text``)."""
    table = Text(columns)
    return "\n".join([table.head(), *(table.row(r) for r in rows)])


def pct(x: float | None, digits: int = 1, sep: str = "") -> str:
    """``0.123`` -> ``12.3%``; ``n/a`` for no figure."""
    return "n/a" if x is None else f"{100 * x:.{digits}f}{sep}%"


def ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds; ``n/a`` for no figure (NaN included)."""
    if seconds is None or seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:.{digits}f}"


def ratio(value: float | None, baseline: float | None, digits: int = 3) -> str:
    """``value / baseline``, or ``n/a`` when either is missing or the baseline is 0."""
    if value is None or not baseline:
        return "n/a"
    return f"{value / baseline:.{digits}f}"
