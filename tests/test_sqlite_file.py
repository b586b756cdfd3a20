"""The SQLite file: created private, and deleted or replaced under a running memproxy (its connections
would go on with the old file, and every turn written there would be gone at the next start: the
store refuses instead, reads and writes alike, a 503, `X-Memproxy-Stored: false`, `/readyz` not ready,
until restarted)."""

from __future__ import annotations

import os
import stat
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


async def test_a_database_file_memproxy_creates_is_its_users_alone(tmp_path: Path) -> None:
    """It holds every conversation: readable by the server's user only, its log files too, whatever
    the umask says. A file that was there keeps the permissions its operator gave it."""
    old = os.umask(0o022)  # the usual one: files readable by every local user
    try:
        path = tmp_path / "new" / "memproxy.db"
        store = await SQLiteStore.open(f"sqlite:///{path}")
        try:
            await store.record_turn(turn(None, [user("one"), assistant("two")], tenant="t", session_id="s"))
            files = sorted(tmp_path.glob("new/memproxy.db*"))
            assert [f.name for f in files] == ["memproxy.db", "memproxy.db-shm", "memproxy.db-wal"]
            assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
        finally:
            await store.close()
        shared = tmp_path / "shared.db"
        shared.touch(0o640)
        store = await SQLiteStore.open(f"sqlite:///{shared}")
        await store.close()
        assert stat.S_IMODE(shared.stat().st_mode) == 0o640
    finally:
        os.umask(old)
