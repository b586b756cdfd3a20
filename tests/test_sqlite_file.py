"""The SQLite file deleted or replaced under a running memproxy: its connections would go on with the
old file, and every turn written there would be gone at the next start. The store refuses instead,
reads and writes alike (a 503, `X-Memproxy-Stored: false`, `/readyz` not ready), until restarted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import assistant, user
from memproxy.store import SQLiteStore
from memproxy.store.errors import StoreUnavailable
from test_store_contract import turn


@pytest.mark.parametrize("change", ["deleted", "replaced"])
async def test_a_database_file_deleted_or_replaced_is_refused_until_restart(tmp_path: Path, change: str) -> None:
    path = tmp_path / "memproxy.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        await store.record_turn(turn(None, [user("one"), assistant("two")], tenant="t", session_id="s"))
        await store.ping()
        if change == "deleted":
            for file in tmp_path.glob("memproxy.db*"):
                file.unlink()
        else:  # a backup moved over it
            backup = await SQLiteStore.open(f"sqlite:///{tmp_path / 'backup.db'}")
            await backup.close()
            os.replace(tmp_path / "backup.db", path)
        with pytest.raises(StoreUnavailable):
            await store.ping()
        session = None
        with pytest.raises(StoreUnavailable):
            session = await store.get_session("t", "s")
        with pytest.raises(StoreUnavailable):
            await store.record_turn(turn(session, [user("three"), assistant("four")], tenant="t", session_id="s2"))
    finally:
        await store.close()
    # Restarted, it serves the file now at the path, and nothing refused was written anywhere.
    again = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        await again.ping()
        assert await again.get_session("t", "s2") is None
    finally:
        await again.close()
