"""A 404 that names the path a client meant: an OpenAI client whose base URL lacks ``/v1``
asks for ``/chat/completions``; an Anthropic client given one ending in ``/v1`` asks for
``/v1/v1/messages``. Answered in the API's own error shape."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.api import anthropic
from router.core.errors import APIError


def _routed(app: web.Application, method: str, path: str) -> bool:
    for resource in app.router.resources():
        info = resource.get_info()
        if info.get("path") == path or info.get("formatter") == path:
            return any(route.method in (method, "*") for route in resource)
    return False


def meant_path(app: web.Application, method: str, path: str) -> str | None:
    """The gateway's route ``path`` was most likely meant to reach, if any."""
    candidates = []
    if path.startswith("/v1/v1/"):
        candidates.append(path[len("/v1") :])
    elif not path.startswith("/v1/"):
        candidates.append("/v1" + path)
    for candidate in candidates:
        if _routed(app, method, candidate):
            return candidate
    return None


def wrong_base_path(request: web.Request, headers: dict[str, Any]) -> web.Response | None:
    """The 404 for a request whose path misses or doubles ``/v1``; None for any other path."""
    meant = meant_path(request.app, request.method, request.path)
    if meant is None:
        return None
    origin = f"{request.scheme}://{request.host}"
    said = f"no route {request.method} {request.path}; did you mean {meant}?"
    if meant.startswith("/v1/messages"):
        hint = f'Anthropic clients take the base URL without /v1: base_url="{origin}"'
        error = APIError(404, f"{said} ({hint})", code="wrong_base_path")
        return anthropic.error_response(error, headers)
    hint = f'OpenAI clients take the base URL ending in one /v1: base_url="{origin}/v1"'
    return APIError(404, f"{said} ({hint})", code="wrong_base_path").response(headers)
