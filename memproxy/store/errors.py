"""The store's own failure: the database could not be reached or did not do what was asked.

Every backend turns what its driver raises (a refused or dropped connection, a file locked past its
busy timeout, a full disk, a statement the database rejected) into `StoreUnavailable`, so the layers
above tell a sick store from a bug without knowing which database runs underneath, and the HTTP layer
maps it to one OpenAI-shaped 503 (`memproxy.app`). The driver's exception stays as `__cause__`, for the
log line; its text never reaches a client (it may quote stored content). Nothing here imports from the
HTTP layer. A refusal the store decides itself (the session moved meanwhile) is no failure: it is
`StoreConflict`, which the HTTP layer answers with a 409 `session_conflict` and the store's message
(the message names ids and what changed, never stored content).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg


class StoreUnavailable(Exception):
    """The store failed; `__cause__` holds the driver's exception. Retrying later may succeed."""


class StoreConflict(Exception):
    """The store refused a write because the session is not what the caller read (a turn, summary,
    fork or import against a history that moved, or an id that exists). Nothing was written;
    retrying from a fresh read may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionDeleted(StoreConflict):
    """A turn's session was deleted while the turn was upstream. Nothing of the turn was written
    but what it cost, which counts with the tenant's deleted sessions."""


# What the drivers raise when the database, not memproxy, is at fault: every sqlite3 error (locked,
# full, read-only, corrupt, closed); every PostgreSQL error (a statement the server cancelled at its
# `statement_timeout`, a row lock not had within `lock_timeout`, a session ended for idling in a
# transaction among them); asyncpg's lost connections, and its protocol state broken by one lost
# mid-operation (`InternalClientError`: "cannot switch to state ..."); the socket errors of
# connecting, and a server that did not answer in time (asyncpg's connect, pool and command timeouts).
DRIVER_ERRORS = (sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                 OSError, asyncio.TimeoutError)


@contextmanager
def translated() -> Iterator[None]:
    """Driver errors raised in the block as `StoreUnavailable`."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise StoreUnavailable(f"the store failed: {type(exc).__name__}") from exc
