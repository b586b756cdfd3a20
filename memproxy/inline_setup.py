"""litellm's synchronous set-up of a call, run on the event loop instead of a thread.

`litellm.acompletion` (and its embedding, moderation, Responses... calls) begins by running the
synchronous `completion` in the loop's default executor: provider lookup, parameter mapping and the
request's body, about a millisecond of pure Python, after which the loop awaits the HTTP call that
`completion` handed back. The loop waits for that thread anyway, and the GIL lets only one of them
run, so the thread buys nothing and costs a hand-off each way (a wake-up of the thread, a wake-up of
the loop through its self-pipe, the GIL passed twice). Measured on this machine with
`bench/bare.py`'s loop: 2.5-2.8 ms a call at p50 on the thread, 1.9-2.2 ms run in place, and as
much CPU saved (docs/benchmarks.md).

`InlineSetup` is the loop's default executor (`install`); it runs a call in place only when it is
the first hand-off of a litellm call made inside `inline()`, and only where the set-up does no I/O
(`Provider` decides: chat and the other endpoints, not the Responses API, on OpenAI-compatible
providers, which pass a message's parts on as they are, unless a `file` part names a URL litellm
downloads; litellm fetches an image URL while it builds an Anthropic or Gemini request, and asks a
cloud for credentials while it builds a Vertex, Bedrock or Azure AD one, which must not hold the
loop). Everything else submitted to it, a DNS lookup included, runs on its threads as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

# Set by `inline()` in the task that makes the call; `InlineSetup.submit` clears it (in that task's
# context, which is current while litellm submits), so only the call's first hand-off runs in place.
_ASKED: ContextVar[bool] = ContextVar("memproxy_inline_setup", default=False)


class InlineSetup(ThreadPoolExecutor):
    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if not _ASKED.get():
            return super().submit(fn, *args, **kwargs)
        _ASKED.set(False)
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller's to see, as from a thread
            future.set_exception(exc)
        return future


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Make an `InlineSetup` `loop`'s default executor (the loop shuts it down as it would its own)."""
    loop.set_default_executor(InlineSetup(thread_name_prefix="memproxy-executor"))


@contextmanager
def inline(wanted: bool = True) -> Iterator[None]:
    """Within it, the next executor hand-off of this task runs in place (where `wanted`, and where
    the loop's executor is an `InlineSetup`; elsewhere it has no effect)."""
    if not wanted:
        yield
        return
    token = _ASKED.set(True)
    try:
        yield
    finally:
        _ASKED.reset(token)
