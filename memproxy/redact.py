"""What logs may say about a session: a short digest of its tenant and id, never the id itself
(it may name a person), nor any content, metadata or key."""

from __future__ import annotations

import hashlib


def session_digest(tenant: str, session_id: str) -> str:
    return hashlib.sha256(f"{tenant}\x00{session_id}".encode()).hexdigest()[:12]
