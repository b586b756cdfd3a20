"""The numbered migrations of each dialect, read from the package's `migrations/<dialect>/` folder.

Each backend applies them its own way (SQLite one write transaction each, PostgreSQL all in one
under an advisory lock) and records each id in `schema_migrations`; what is pending, and the SQL
of each, comes from here, so both backends read the same files the same way.
"""

from __future__ import annotations

from importlib import resources
from typing import Literal

Dialect = Literal["sqlite", "postgres"]


def migrations(dialect: Dialect = "sqlite") -> list[tuple[str, str]]:
    """The numbered migrations of a dialect, in order: (id, SQL)."""
    folder = resources.files("memproxy.store") / "migrations" / dialect
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8")) for f in files]


def statements(sql: str) -> list[str]:
    """A migration's statements: `--` comment lines dropped, split on `;` (the migrations put no
    `;` inside a literal)."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
