"""Typed keys for everything the application holds; imports nothing at run time from the package."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .auth import Caller
    from .concurrency import BackgroundTasks, SessionLocks
    from .config import Config
    from .metrics import Metrics
    from .observe import Notes
    from .provider import Provider
    from .store import Store
    from .memory.sent import SentHistories
    from .memory.summaries import Summarizer

CONFIG: web.AppKey[Config] = web.AppKey("config")
STORE: web.AppKey[Store] = web.AppKey("store")
PROVIDER: web.AppKey[Provider] = web.AppKey("provider")
TASKS: web.AppKey[BackgroundTasks] = web.AppKey("tasks")
LOCKS: web.AppKey[SessionLocks] = web.AppKey("locks")
SUMMARIZER: web.AppKey[Summarizer] = web.AppKey("summarizer")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
HISTORIES: web.AppKey[SentHistories] = web.AppKey("histories")  # the older parts of histories as sent
# The OpenAI endpoints' routes besides `/v1`'s (`/chat/completions`, `/openai/models/{model}`), as declared.
ALIASES: web.AppKey[frozenset[str]] = web.AppKey("aliases")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Registers an OpenAI endpoint (`memproxy.app`): method, path under `/v1`, handler.
AddRoute = Callable[[str, str, Handler], None]

CALLER: web.RequestKey[Caller] = web.RequestKey("caller")  # who the API key names
NOTES: web.RequestKey[Notes] = web.RequestKey("notes")  # what the request's log line and metrics say
