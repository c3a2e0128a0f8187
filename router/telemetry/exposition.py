"""Prometheus text exposition, read: the one parser of a ``/metrics`` page, shared by the
gateway's scrapes of its replicas (router/fleet/replicas.py, every second) and the load tests'
(loadtest/metrics_scrape.py). A regex over sample lines, not a full parser: comments,
``HELP``/``TYPE`` lines and values that are not numbers are skipped."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


@functools.cache
def _sample_line(prefix: str) -> re.Pattern[str]:
    name = re.escape(prefix) + r"[a-zA-Z0-9_:]*" if prefix else r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    return re.compile(rf"^({name})(?:\{{(.*)\}})?\s+(\S+)", re.M)


def samples(text: str, prefix: str = "") -> Iterator[tuple[str, str, float]]:
    """``(name, label text, value)`` for every sample whose name starts with ``prefix``;
    ``labels`` reads the label text (left raw: most readers never need it)."""
    for name, raw_labels, value in _sample_line(prefix).findall(text):
        try:
            v = float(value)
        except ValueError:
            continue
        yield name, raw_labels, v


def labels(raw: str) -> dict[str, str]:
    """``a="1",b="x\\"y"`` -> ``{"a": "1", "b": 'x"y'}`` (escapes undone)."""
    return {
        k: _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
        for k, v in _LABEL.findall(raw)
    }


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The whole page: ``{metric name: [(labels, value), ...]}``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, raw_labels, value in samples(text):
        out.setdefault(name, []).append((labels(raw_labels), value))
    return out
