"""Owned background work and per-session serialisation.

`BackgroundTasks` runs work that must finish even if the request that started it is cancelled (a
client disconnecting): the task belongs to the application and is awaited at shutdown, never left
behind. `SessionLocks` runs one request at a time per session in this process, so concurrent
requests on a session see each other's turns in order instead of interleaving; a lock disappears
when nobody holds or waits for it. Across processes the store's conflict check keeps turns whole.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._optional: set[asyncio.Task[Any]] = set()
        self._closing = False

    def spawn(self, work: Coroutine[Any, Any, T], optional: bool = False) -> asyncio.Task[T]:
        """Own `work`; an `optional` task (a summary) is cancelled at shutdown instead of awaited.
        It also outlives the request that started it, so it runs in a context of its own: what it
        does is not charged to that request's timings (`memproxy.timing`)."""
        if self._closing:
            work.close()
            raise RuntimeError("shutting down")
        context = contextvars.Context() if optional else None
        task = asyncio.get_running_loop().create_task(work, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if optional:
            self._optional.add(task)
            task.add_done_callback(self._optional.discard)
        return task

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` to its end even if the caller is cancelled meanwhile.

        A cancelled caller still waits for that end before its cancellation goes on, so what it holds
        (a session's lock) is released only once the work is done: the next request on the session
        sees the turn a disconnected client left instead of racing its write.
        """
        task = self.spawn(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    def __len__(self) -> int:
        """Work under way that shutdown waits for (a turn being written), optional work aside."""
        return len(self._tasks - self._optional)

    async def close(self) -> None:
        self._closing = True
        for task in self._optional:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class SessionLocks:
    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, tenant: str, session_id: str) -> AsyncIterator[None]:
        key = (tenant, session_id)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
