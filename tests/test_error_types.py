"""The one table from HTTP status to OpenAI error type (`memproxy.errors.ERROR_TYPES`), checked
without a server: every error class and every provider status answers the type it answered
before the table, and the store's refusal becomes the 409 it always was."""

from __future__ import annotations

import pytest

from memproxy import errors
from memproxy.store.errors import StoreConflict
from memproxy.upstream import status_error, timed_out, unreachable


@pytest.mark.parametrize(("error", "status", "type", "code"), [
    (errors.ProxyError("x"), 500, "server_error", None),
    (errors.ProxyError("x", status=503, code="store_unreachable"), 503, "server_error", "store_unreachable"),
    (errors.ProxyError("x", status=502, code="upstream_incomplete"), 502, "server_error", "upstream_incomplete"),
    (errors.BadRequest("x"), 400, "invalid_request_error", None),
    (errors.ContextLengthExceeded("x"), 400, "invalid_request_error", "context_length_exceeded"),
    (errors.Unauthorized("x"), 401, "authentication_error", "invalid_api_key"),
    (errors.Forbidden("x"), 403, "permission_error", "forbidden"),
    # OpenAI answers an unknown model so; an unknown route is the table's not_found_error.
    (errors.NotFound("x", code="model_not_found"), 404, "invalid_request_error", "model_not_found"),
    (errors.Conflict("x"), 409, "invalid_request_error", "session_conflict"),
    (errors.UpstreamError("x"), 502, "upstream_error", "upstream_error"),
    (errors.UpstreamError("x", code="summarization_failed"), 502, "upstream_error", "summarization_failed"),
    (timed_out(1), 504, "upstream_error", "upstream_timeout"),
    (unreachable(OSError("refused")), 502, "upstream_error", "upstream_unreachable"),
])
def test_each_error_answers_its_status_type_and_code(
    error: errors.ProxyError, status: int, type: str, code: str | None
) -> None:
    assert (error.status, error.type, error.code) == (status, type, code)
    assert error.body() == {"error": {"message": error.message, "type": type, "code": code, "param": None}}


@pytest.mark.parametrize(("status", "type", "code"), [
    (400, "invalid_request_error", "upstream_bad_request"),
    (401, "authentication_error", "upstream_unauthorized"),
    (403, "permission_error", "upstream_forbidden"),
    (404, "not_found_error", "upstream_not_found"),
    (409, "upstream_error", "upstream_error"),  # a provider status the table does not name
    (422, "upstream_error", "upstream_error"),
    (429, "rate_limit_error", "rate_limit_exceeded"),
    (500, "upstream_error", "upstream_error"),
    (503, "upstream_error", "upstream_error"),
    (None, "upstream_error", "upstream_error"),  # no status: a 502
    (200, "upstream_error", "upstream_error"),
])
def test_a_provider_status_maps_through_the_same_table(status: int | None, type: str, code: str) -> None:
    error = status_error(status, "provider says no")
    assert (error.status, error.type, error.code) == (status if status and status >= 400 else 502, type, code)
    if status in errors.ERROR_TYPES:
        assert error.type == errors.ERROR_TYPES[status] == errors.error_type(status)


def test_the_fallback_is_by_who_is_at_fault() -> None:
    assert [errors.error_type(s) for s in (404, 405, 413, 500, 503)] == [
        "not_found_error", "invalid_request_error", "invalid_request_error", "server_error", "server_error"]
    assert [errors.error_type(s, upstream=True) for s in (404, 405, 500)] == [
        "not_found_error", "upstream_error", "upstream_error"]


def test_the_stores_refusal_is_todays_409() -> None:
    refusal = StoreConflict("a session 's1' already exists")
    error = errors.Conflict.from_store(refusal)
    assert error.__cause__ is refusal and error.status == 409
    assert error.body() == {"error": {"message": "a session 's1' already exists", "type": "invalid_request_error",
                                      "code": "session_conflict", "param": None}}
    assert not isinstance(refusal, errors.ProxyError)  # the store's error is its own
