"""Errors that carry their HTTP status and OpenAI error fields.

Handlers raise these; one middleware (`memproxy.app`) turns every one of them into the body
`{"error": {"message", "type", "code", "param"}}`, so no handler formats an error itself.

`ERROR_TYPES` is the one table from an HTTP status to its OpenAI error type, for memproxy's own
errors and the provider's alike (`memproxy.upstream` maps a provider's status through it). A status
it does not name falls back by who is at fault: memproxy's own 4xx is an `invalid_request_error`
and its 5xx a `server_error`; any other provider status is an `upstream_error`.

The store answers in its own terms (`memproxy.store.errors`) and imports nothing from here: its
refusal `StoreConflict` becomes `Conflict`, a 409, through `Conflict.from_store`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the store's error is only named here: the store package imports this module
    from .store.errors import StoreConflict

ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "rate_limit_error", "server_error", "upstream_error"]

ERROR_TYPES: dict[int, ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int, *, upstream: bool = False) -> ErrorType:
    """The OpenAI error type of `status`, for an error of memproxy's own or (`upstream`) the provider's."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    if upstream:
        return "upstream_error"
    return "invalid_request_error" if status < 500 else "server_error"


class ProxyError(Exception):
    status = 500
    # The class's OpenAI error type where it is not the table's for its status.
    error_type: ErrorType | None = None
    code: str | None = None
    headers: Mapping[str, str] = MappingProxyType({})  # sent with the error (`Retry-After`)

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        type: ErrorType | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.type: ErrorType = type or self.error_type or self._type_of(self.status)

    @staticmethod
    def _type_of(status: int) -> ErrorType:
        return error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class BadRequest(ProxyError):
    status = 400


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(ProxyError):
    status = 401
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    code = "forbidden"


class NotFound(ProxyError):
    """A session or model the request names does not exist. OpenAI answers an unknown model with
    an `invalid_request_error` (code `model_not_found`), not the `not_found_error` of an unknown
    route, and so does memproxy."""

    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class Conflict(ProxyError):
    status = 409
    code = "session_conflict"

    @classmethod
    def from_store(cls, exc: StoreConflict) -> Conflict:
        """The 409 a store's refusal is answered with: the store's message, the cause kept."""
        error = cls(exc.message)
        error.__cause__ = exc
        return error


class ServerBusy(ProxyError):
    """This process holds as many request bodies as `server.max_body_bytes_in_flight` allows: a
    503 with `Retry-After`, which the OpenAI SDKs wait for and retry."""

    status = 503
    code = "server_busy"
    headers = MappingProxyType({"Retry-After": "1"})


class UpstreamError(ProxyError):
    """An error reported by (or on the way to) the model provider; keeps its status."""

    status = 502
    code = "upstream_error"
    upstream_status: int | None = None  # the provider's own HTTP status, where it answered with one
    # `headers`: what the provider's error response said a client should back off by
    # (`retry-after`, `x-ratelimit-*`), relayed with the error (`memproxy.upstream.backoff_headers`).

    @staticmethod
    def _type_of(status: int) -> ErrorType:
        return error_type(status, upstream=True)


def store_unavailable_body() -> dict[str, Any]:
    """What a request gets when the store fails (`memproxy.store.StoreUnavailable`): a 503, or an
    error event ending a stream."""
    return error_body("The session store is unavailable; memory could not be read or written. Retry later.",
                      "server_error", "store_unavailable")


def error_body(
    message: str, type: ErrorType, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}
