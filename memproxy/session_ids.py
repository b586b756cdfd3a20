"""Session ids: 1-128 characters of `[A-Za-z0-9._:-]`, sent in `X-Session-Id` or in a path."""

from __future__ import annotations

import re

SESSION_HEADER = "X-Session-Id"
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def is_session_id(value: str) -> bool:
    return _SESSION_ID.fullmatch(value) is not None
