"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


ECHO_CHARS = 200  # a client's string quoted back in an error: at most this much of it
MAX_MESSAGE_CHARS = 1024  # an error message, whatever it quotes


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` for an error message: cut at ``limit`` characters (an 8 MB model name was
    echoed whole), the cut said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """An error that reaches the client as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        close_connection: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        # Answer, then close: for a request whose body was not (fully) read, so the rest of
        # it is neither read nor waited for.
        self.close_connection = close_connection
        self.headers = headers or {}  # sent with the error (e.g. Retry-After on a 429)
        self.status = status
        self.message = message  # cut above: whatever of the client's it quotes, it stays short
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "APIError")

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                # A string or null, as OpenAI sends it (vLLM sends the status as an int;
                # clients match on strings, and one type is what a client can switch on).
                "code": self.code or None,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers={**self.headers, **(headers or {})},
        )
        if self.close_connection:
            resp.force_close()
        return resp


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
