"""URLs as they may be shown: in logs, errors and the start-up summary, a URL's user info
(``redis://user:secret@host``) never shows."""

from __future__ import annotations

import re

_URL_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def mask_url_credentials(text: str) -> str:
    """``redis://user:secret@host`` -> ``redis://***@host``: a URL's user info never shows."""
    return _URL_CREDENTIALS.sub(r"\1***@", text)
