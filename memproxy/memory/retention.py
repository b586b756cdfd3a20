"""Retention: when a session has idled past its TTL, the sweep that deletes such sessions, and the
cap on the messages one session keeps (`max_messages_per_session`).

An expired session behaves as new in every respect (a turn restarts it, the admin API shows it
empty) whether or not the sweep has deleted it yet; the sweep only reclaims the space, so it may
run late or fail without changing what a client sees.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..metrics import Metrics
from ..store import AdminStore, SessionState, StoreUnavailable, TurnStore

log = logging.getLogger("memproxy")  # the logger the sweep always logged to


def expired_before(idle_ttl: float | None) -> float | None:
    """With `retention.idle_ttl_seconds`, the last activity before which a session has expired."""
    return None if idle_ttl is None else time.time() - idle_ttl


def has_expired(session: SessionState | None, idle_ttl: float | None) -> bool:
    """Whether a stored session idled past its TTL: it then behaves as new in every respect."""
    cutoff = expired_before(idle_ttl)
    return session is not None and cutoff is not None and session.updated_at < cutoff


async def keep_alive(store: TurnStore, session: SessionState | None, idle_ttl: float | None) -> None:
    """Before a turn on a session idle for more than half its TTL (not past it): mark it active now.
    The sweep deletes a session once idle as long again as a turn may take, but a stream's
    `timeout_seconds` bounds only the wait between its chunks: a long answer on a session planned
    just before its TTL would have its whole history swept from under it. A session used within
    half its TTL is far from the sweep, and costs nothing here."""
    if session is None or idle_ttl is None:
        return
    now = time.time()
    if now - idle_ttl <= session.updated_at < now - idle_ttl / 2:
        await store.touch(session, now)


async def sweep(store: AdminStore, ttl: float, interval: float, metrics: Metrics | None = None) -> None:
    """Delete expired sessions every `interval` seconds, for as long as the app runs."""
    while True:
        try:
            removed = await store.prune(time.time() - ttl)
            if removed:
                log.info("retention sweep removed=%d", removed)
        except Exception as exc:  # the next sweep tries again
            log.error("retention sweep failed: %s", type(exc).__name__)
            if metrics is not None and isinstance(exc, StoreUnavailable):
                metrics.store_error("sweep")
        await asyncio.sleep(interval)


async def cap_messages(store: TurnStore, tenant: str, session_id: str, cap: int) -> None:
    """After a recorded turn: delete the session's oldest messages beyond `cap` that can never be
    sent again (superseded, or covered by the summary in use)."""
    session = await store.get_session(tenant, session_id)
    if session is not None:
        await store.cap_messages(session, cap)
