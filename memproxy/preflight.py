"""What `memproxy serve` checks before it starts anything, and `memproxy check-config` checks with
the same function, so the two cannot drift.

`load_config` has checked the file itself (every value, the store's kind, the summariser's name).
Here is what needs more than the file: the address (a non-loopback one needs `auth.keys`, or
`server.allow_unauthenticated`), the store (a SQLite file must be creatable, or an existing one
readable and writable, where the URL says, without creating anything; a PostgreSQL server must
accept a connection within `CONNECT_TIMEOUT_SECONDS`, and `storage.schema` exist or be creatable,
and take the role's tables), and every model's context window (as
configured, else litellm's local model info: litellm is imported only for a model that sets none).
Each failure is a `ConfigError` naming its key, and every one is reported, not only the first.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from .config import AuthConfig, Config, ConfigError, ServerConfig, StorageConfig
from .provider import provider_problems
from .store.postgres import schema_exists
from .store.sqlite import sqlite_path

CONNECT_TIMEOUT_SECONDS = 10.0  # a server that has not answered by then is down for `serve` too
_SQLITE_HEADER = b"SQLite format 3\x00"


def problems(config: Config) -> list[ConfigError]:
    """Everything that would stop `serve` from starting with `config`, cheapest check first."""
    found = []
    if (why := unguarded_address(config.server, config.auth)) is not None:
        found.append(ConfigError("server.host", why))
    return found + storage_problems(config.storage) + provider_problems(config)


def unguarded_address(server: ServerConfig, auth: AuthConfig) -> str | None:
    if auth.keys or server.is_loopback or server.allow_unauthenticated:
        return None
    return (f"refusing to bind {server.host} with no auth.keys configured; add keys, bind 127.0.0.1, "
            "or allow it (server.allow_unauthenticated, or serve --allow-unauthenticated)")


def storage_problems(storage: StorageConfig) -> list[ConfigError]:
    if storage.is_postgres:
        return asyncio.run(_postgres_problems(storage.url, storage.schema))
    why = sqlite_problem(sqlite_path(storage.url))
    return [] if why is None else [ConfigError("storage.url", why)]


def sqlite_problem(path: str) -> str | None:
    """Why `SQLiteStore.open` would fail on `path`: it creates missing folders and the file, and
    writes `-wal` and `-shm` files beside it."""
    if path == ":memory:":
        return None
    file = Path(path)
    if not file.exists():
        folder = file.parent
        while not folder.exists():  # the nearest one that exists; serve creates the rest
            folder = folder.parent
        if not folder.is_dir():
            return f"cannot create {path}: {folder} is not a folder"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"cannot create {path}: the folder {folder} is not writable"
        return None
    if not file.is_file():
        return f"{path} is not a file"
    if not os.access(file, os.R_OK | os.W_OK):
        return f"{path} is not readable and writable"
    with file.open("rb") as opened:
        header = opened.read(len(_SQLITE_HEADER))
    if header and header != _SQLITE_HEADER:  # an empty file is a new database to SQLite
        return f"{path} is not a SQLite database"
    if not os.access(file.parent, os.W_OK | os.X_OK):
        return f"the folder of {path} is not writable (SQLite writes its -wal and -shm files there)"
    return None


async def _postgres_problems(url: str, schema: str | None) -> list[ConfigError]:
    try:
        conn = await asyncpg.connect(url, timeout=CONNECT_TIMEOUT_SECONDS)
    except Exception as exc:  # whatever it is, `serve` would stop on it
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        try:
            password = urlsplit(url).password
        except ValueError:  # not a URL at all ("postgresql://[::1"): nothing of it is quoted
            return [ConfigError("storage.url", "cannot connect to PostgreSQL: the URL is not valid")]
        why = why.replace(password, "***") if password else why
        return [ConfigError("storage.url", f"cannot connect to PostgreSQL: {why}")]
    try:
        if schema:
            await schema_exists(conn, schema)  # the store would stop on a schema it cannot use
    except ConfigError as exc:
        return [exc]
    finally:
        await conn.close()
    return []
