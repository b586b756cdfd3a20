"""Errors that carry their HTTP status and OpenAI error fields.

Handlers raise these; one middleware (`memproxy.app`) turns every one of them into the body
`{"error": {"message", "type", "code", "param"}}`, so no handler formats an error itself.
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(ProxyError):
    status = 409
    type = "invalid_request_error"
    code = "session_conflict"


class UpstreamError(ProxyError):
    """An error reported by (or on the way to) the model provider; keeps its status."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"


def store_unavailable_body() -> dict[str, Any]:
    """What a request gets when the store fails (`memproxy.store.StoreUnavailable`): a 503, or an
    error event ending a stream."""
    return error_body("The session store is unavailable; memory could not be read or written. Retry later.",
                      "server_error", "store_unavailable")


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}
