"""What every part of the configuration reports problems with."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from router.core.urls import mask_url_credentials

__all__ = ["ConfigError", "did_you_mean", "mask_url_credentials"]


class ConfigError(ValueError):
    """Configuration problems, phrased for the person who wrote the config: ``problems``
    lists every one found (the message is them, one a line)."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'block_size'?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
