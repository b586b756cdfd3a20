"""The numbered migrations of each dialect, read from the package's `migrations/<dialect>/` folder.

Each backend applies them its own way (SQLite one write transaction each, PostgreSQL all in one
under an advisory lock) and records each id in `schema_migrations`; what is pending, and the SQL
of each, comes from here, so both backends read the same files the same way.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Literal

Dialect = Literal["sqlite", "postgres"]
# The migrations after whose statements each backend fills, in the same transaction, the search
# text and recall lines of the messages that lack them (`memproxy.store.sql.recall.backfill_recall`):
# the one that made the index, and each `<number>_..._recall_repair` (numbered in each dialect's
# order) for what earlier releases left short or indexed otherwise.
BACKFILL_SEARCH = "0009_recall"
REPAIR_RECALL = "recall_repair"


def fills_recall(migration_id: str) -> bool:
    return migration_id == BACKFILL_SEARCH or migration_id.endswith("_" + REPAIR_RECALL)


def newer_than_known(applied: set[str], dialect: Dialect) -> str | None:
    """Why a store cannot be served by this release (None: it can): migrations recorded that this
    release does not have, applied by a newer one. Its code would write rows the newer schema
    expects more of (an index, a column), which nothing would ever fill in."""
    unknown = sorted(applied - {migration_id for migration_id, _ in migrations(dialect)})
    if not unknown:
        return None
    return (f"the store was migrated by a newer memproxy (migration {', '.join(unknown)} is not in this release): "
            "run that release or a newer one, or restore a backup taken before it")


def migrations(dialect: Dialect = "sqlite") -> list[tuple[str, str]]:
    """The numbered migrations of a dialect, in order: (id, SQL)."""
    folder = resources.files("memproxy.store") / "migrations" / dialect
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8")) for f in files]


_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|(\$\w*\$)|\b(BEGIN|END|CASE)\b|(;)", re.IGNORECASE)


def statements(sql: str) -> list[str]:
    """A migration's statements: `--` comment lines dropped, split on the `;` that end them, not
    those inside a quoted literal or name, a dollar-quoted body (PostgreSQL's functions) or a
    trigger's `BEGIN ... END` (SQLite's; a `CASE ... END` inside one is counted too)."""
    text = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
    out, start, depth, pos = [], 0, 0, 0
    while (match := _TOKEN.search(text, pos)) is not None:
        pos = match.end()
        dollar, keyword, semicolon = match.groups()
        if dollar:  # skip to the closing tag
            close = text.find(dollar, pos)
            pos = len(text) if close == -1 else close + len(dollar)
        elif keyword:
            word = keyword.upper()
            if word in ("BEGIN", "CASE") and (depth or word == "BEGIN" and _is_trigger(text[start:match.start()])):
                depth += 1
            elif word == "END" and depth:
                depth -= 1
        elif semicolon and not depth:
            out.append(text[start:match.start()])
            start = pos
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def _is_trigger(head: str) -> bool:
    return re.match(r"\s*CREATE\s+(TEMP\w*\s+)?TRIGGER\b", head, re.IGNORECASE) is not None
