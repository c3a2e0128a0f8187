"""Credentials never reach a log line, at any level: every log record the process makes (the
gateway's loggers, aiohttp's, any other) has its message and traceback rewritten with API
keys, bearer tokens, admin keys and cookies replaced, as it is made (a log record factory:
a filter on a logger would miss its children's records). aiohttp logs a malformed request
head verbatim, ``Authorization: Bearer sk-...`` included; a client can put a key anywhere.
Only records that are emitted are made, so the cost is per line logged."""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

MASK = "[redacted]"
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


def redact_record(record: logging.LogRecord) -> None:
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


def install() -> None:
    """Make every log record of this process redacted (once)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        redact_record(record)
        return record

    factory.redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
