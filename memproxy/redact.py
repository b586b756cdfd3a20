"""What logs may say about a session: never its content, metadata or keys. The request line
(`memproxy.observe`) carries the session id the client chose, an identifier; the lines of
background work (a supersede, a summary) name the session by this short digest of tenant and id."""

from __future__ import annotations

import hashlib


def session_digest(tenant: str, session_id: str) -> str:
    return hashlib.sha256(f"{tenant}\x00{session_id}".encode()).hexdigest()[:12]
