"""The stores under test: SQLite on a temp file, PostgreSQL in a schema of its own per test.

PostgreSQL is the server of this machine (`MEMPROXY_TEST_POSTGRES_URL`, by default
postgresql://root@127.0.0.1:5432/test). Where it cannot be reached the PostgreSQL cases are skipped
with the reason, except under CI (`CI` set), where that is a failure.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from memproxy.config import StorageConfig
from memproxy.store import Store, open_store
from memproxy.store.postgres import numbered

POSTGRES_URL = os.environ.get("MEMPROXY_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
_reachable: bool | None = None


async def _ping() -> bool:
    try:
        conn = await asyncio.wait_for(asyncpg.connect(POSTGRES_URL), 5)
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False
    await conn.close()
    return True


async def require_postgres() -> None:
    global _reachable
    if _reachable is None:
        _reachable = await _ping()
    if not _reachable:
        message = f"PostgreSQL is not reachable at {POSTGRES_URL}"
        if os.environ.get("CI"):
            pytest.fail(message + " (required under CI)")
        pytest.skip(message + "; set MEMPROXY_TEST_POSTGRES_URL to run these cases")


@dataclass
class StoreUnderTest:
    """One database for one test, and a way to look into it from an independent connection."""

    kind: str
    storage: StorageConfig
    path: Path | None = None

    async def open(self) -> Store:
        return await open_store(self.storage)

    async def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            assert self.path is not None
            with closing(sqlite3.connect(self.path)) as db:
                found = [tuple(r) for r in db.execute(sql, params)]
                db.commit()  # a statement that writes is committed, as on PostgreSQL
                return found
        conn = await self._postgres()
        try:
            return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]
        finally:
            await conn.close()

    @asynccontextmanager
    async def uncommitted(self, sql: str, *params: Any) -> AsyncIterator[None]:
        """`sql` run in a write transaction left open for the block, then committed."""
        if self.kind == "sqlite":
            assert self.path is not None
            with closing(sqlite3.connect(self.path, isolation_level=None)) as db:
                db.execute("BEGIN IMMEDIATE")
                db.execute(sql, params)
                yield
                db.execute("COMMIT")
            return
        conn = await self._postgres()
        try:
            async with conn.transaction():
                await conn.execute(numbered(sql), *params)
                yield
        finally:
            await conn.close()

    async def _postgres(self) -> asyncpg.Connection:
        schema = self.storage.schema
        return await asyncpg.connect(POSTGRES_URL, server_settings={"search_path": f'"{schema}"' if schema else ""})

    async def drop(self) -> None:
        if self.kind == "postgres" and self.storage.schema:
            conn = await asyncpg.connect(POSTGRES_URL)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{self.storage.schema}" CASCADE')
            finally:
                await conn.close()


async def store_under_test(kind: str, tmp_path: Path) -> StoreUnderTest:
    if kind == "sqlite":
        path = tmp_path / "store.db"
        return StoreUnderTest(kind, StorageConfig(url=f"sqlite:///{path}"), path)
    await require_postgres()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    return StoreUnderTest(kind, StorageConfig(url=POSTGRES_URL, schema=schema, pool_max_size=4))
