"""Which session inside a tenant a request belongs to, where the client says so: one agent
session (a Claude Code run, a Responses chain) is one flow, so it cannot starve the tenant's
other sessions."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

CLAUDE_CODE_HEADER = "X-Claude-Code-Session-Id"
_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{1,64})$")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')
MAX_LEN = 128


def _clean(value: Any) -> str | None:
    if isinstance(value, str) and value and len(value) <= MAX_LEN and value.isprintable():
        return value
    return None


def _claude_metadata(user_id: Any) -> str | None:
    """Claude Code's ``metadata.user_id``: JSON with ``session_id`` (newer) or
    ``user_<hash>_account_<id>_session_<uuid>`` (older); any other value is the end user."""
    if not isinstance(user_id, str) or len(user_id) > 4096:
        return None
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and (sid := _clean(parsed.get("session_id"))):
            return "claude:" + sid
    if m := _LEGACY_USER_ID.search(user_id):
        return "claude:" + m.group(1)
    return ("user:" + user_id) if _clean(user_id) else None


class ResponseChains:
    """Responses API: a chain of ``previous_response_id`` links is one session. Maps each
    response id this gateway saw to its chain's first id (bounded LRU)."""

    def __init__(self, size: int = 65_536) -> None:
        self._root: OrderedDict[str, str] = OrderedDict()
        self.size = size

    def root(self, previous: str) -> str:
        found = self._root.get(previous)
        if found is not None:
            self._root.move_to_end(previous)
            return found
        return previous

    def learn(self, head: bytes, session: str) -> None:
        """``head``: the first bytes of a Responses answer, which carry its id."""
        if not session.startswith("chain:"):
            return
        m = _RESPONSE_ID.search(head)
        if m is None:
            return
        self._root[m.group(1).decode()] = session.removeprefix("chain:")
        while len(self._root) > self.size:
            self._root.popitem(last=False)


def session_of(
    endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str], chains: ResponseChains
) -> str:
    """The session key ("" when the client names none: the tenant is one flow)."""
    if sid := _clean(headers.get(CLAUDE_CODE_HEADER)):
        return "claude:" + sid
    if endpoint == "messages":
        metadata = body.get("metadata")
        if isinstance(metadata, dict) and (sid := _claude_metadata(metadata.get("user_id"))):
            return sid
    if endpoint == "responses":
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if sid := _clean(conversation):
            return "conv:" + sid
        if prev := _clean(body.get("previous_response_id")):
            return "chain:" + chains.root(prev)
    if sid := _clean(body.get("user")) or _clean(body.get("safety_identifier")):
        return "user:" + sid
    return ""
