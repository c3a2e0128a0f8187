"""What every part of the configuration reports problems with."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence


class ConfigError(ValueError):
    """Configuration problems, phrased for the person who wrote the config: ``problems``
    lists every one found (the message is them, one a line)."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


_URL_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def mask_url_credentials(text: str) -> str:
    """``redis://user:secret@host`` -> ``redis://***@host``: a URL's user info never shows."""
    return _URL_CREDENTIALS.sub(r"\1***@", text)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'block_size'?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
