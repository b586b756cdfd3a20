"""How the SQL store talks to a database: statements, write scripts and the `Backend` running them.

A `Backend` supplies reads that see only committed data, write scripts, and the dialect's row lock.
Every write is a script: a generator of statements, each `yield` answered with that statement's
rows, run in one transaction. Where no statement needs another's answer, a write is a batch
instead (`Backend.write_batch`): SQLite sends the whole batch to its writer's thread in one trip.
Statements use `?` placeholders (the PostgreSQL backend numbers them), `RETURNING` for new ids and
for what a statement changed, and `CAST(? AS TEXT) IS NULL` where a parameter may be null, so one
text serves both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

Row = Sequence[Any]
T = TypeVar("T")
Step = tuple[str, Sequence[Any]]
Script = Generator[Step, list[Row], T]  # statements out, their rows back in, a result at the end
Outcome = list[Row] | BaseException  # what a statement of a batch returned, or the error it raised


class Backend(Protocol):
    row_lock: str  # appended to a SELECT that must lock the rows it reads
    # The statement that refreshes the query planner's statistics after a bulk copy (None: the
    # database plans without them).
    analyze: str | None

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """A read outside any transaction: it sees committed data only."""
        ...

    async def write(self, script: Script[T]) -> T:
        """Run a script in one write transaction, rolled back if it raises."""
        ...

    async def write_batch(self, steps: Sequence[Step], accept: Callable[[list[Outcome]], T]) -> T:
        """Run `steps` in one write transaction, then `accept` their outcomes, in order, inside it:
        committed if it returns, rolled back if it raises. The first step changes data (on SQLite it
        begins the transaction). A step's error does not stop the batch (a backend may stop sending
        steps after one: those then carry the same error)."""
        ...

    def hits(self, pk: int, key: str, words: Sequence[str], before: int, limit: int) -> Step:
        """A SELECT of (session key, position, score) for the active messages of the session `pk`
        before position `before` that its full-text index matches with any of `words` (indexed
        under `key`, `memproxy.searchtext`), best first (a higher score), at most `limit`."""
        ...

    def postings(self, scope: Sequence[tuple[int, str, int]], words: Sequence[str]) -> Step:
        """A SELECT of (word index, session key, positions) for the sessions of `scope` (key, search
        key, positions before): where each of `words` occurs among their active messages, as the
        full-text index stems it, positions as a list or as comma-separated text; words found
        nowhere have no row."""
        ...

    def row_count(self, table: str) -> str:
        """A scalar subquery of how many rows `table` holds, at a bounded cost: exact where counting
        is cheap, else the database's own estimate past a bound."""
        ...

    async def stems(self, words: Sequence[str]) -> list[tuple[str, ...]]:
        """Each of `words` as the full-text index stems it (the terms `postings` looks it up by,
        without the session key; none for a word the index leaves out), in order."""
        ...

    async def close(self) -> None: ...


async def run_script_async(script: Script[T], fetch: Callable[[str, Sequence[Any]], Awaitable[list[Row]]]) -> T:
    """Drive a script statement by statement with an asynchronous `fetch` (in a transaction)."""
    try:
        step = next(script)
        while True:
            step = script.send(await fetch(*step))
    except StopIteration as done:
        result: T = done.value
        return result


def statement(sql: str, params: Sequence[Any]) -> Script[list[Row]]:
    rows = yield sql, params
    return rows

