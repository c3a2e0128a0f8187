"""Credentials never reach a log line, at any level: a filter on the gateway's logger and
aiohttp's rewrites each record's message (and its traceback) with API keys, bearer tokens,
admin keys and cookies replaced. aiohttp logs a malformed request head verbatim at debug
level, ``Authorization: Bearer sk-...`` included; a client can put a key anywhere."""

from __future__ import annotations

import logging
import re
import traceback

MASK = "[redacted]"
LOGGERS = (
    "prefix_router",
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)
# A credential header's value up to the end of its line (or of the quoted repr it sits in;
# keys hold no backslash or quote); then bearer tokens and sk- style keys anywhere.
_HEADER = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|x-admin-key|api-key|(?:set-)?cookie)"
    r"(\s*[:=]\s*)[^\r\n'\"\\]*"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
_KEY = re.compile(r"\b(sk|pk|rk)-[A-Za-z0-9_-]{6,}")


def redact(text: str) -> str:
    text = _HEADER.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    text = _BEARER.sub(lambda m: m.group(1) + " " + MASK, text)
    return _KEY.sub(lambda m: m.group(1) + "-" + MASK, text)


class RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format: keep the template, drop the arguments
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info:
            text = "".join(traceback.format_exception(*record.exc_info))
            record.exc_text, record.exc_info = redact(text.rstrip("\n")), None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactFilter()


def install() -> None:
    """Add the filter to the gateway's and aiohttp's loggers (once)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
