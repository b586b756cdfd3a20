"""Who a request is about: session ids (1-128 characters of `[A-Za-z0-9._:-]`, sent in
`X-Session-Id` or in a path, but not `.` or `..`: every HTTP client and browser resolves those path
segments away, so such a session could be made but never reached) and the end user a turn is for."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .errors import BadRequest

SESSION_HEADER = "X-Session-Id"
USER_HEADER = "X-Memproxy-User"  # the end user a turn is for (recall across their sessions)
_SESSION_ID = re.compile(r"(?!\.\.?$)[A-Za-z0-9._:-]{1,128}")
SESSION_ID_RULE = "1-128 characters of A-Z a-z 0-9 . _ : -, not . or .. alone"


def is_session_id(value: str) -> bool:
    return _SESSION_ID.fullmatch(value) is not None


def end_user(headers: Mapping[str, str], params: Mapping[str, Any]) -> str | None:
    """Whom a turn is for: the `X-Memproxy-User` header, else the request's `user` field, else its
    `safety_identifier`, which OpenAI has supersede `user` for the same purpose (a string of at most
    256 characters; anything else names no one)."""
    value = headers.get(USER_HEADER)
    if value is not None:
        if not 0 < len(value) <= 256:
            raise BadRequest(f"{USER_HEADER} must be 1-256 characters", param=USER_HEADER)
        return value
    for field in ("user", "safety_identifier"):
        given = params.get(field)
        if isinstance(given, str) and 0 < len(given) <= 256:
            return given
    return None
