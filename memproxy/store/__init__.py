"""Stores: the `Store` protocol (`TurnStore` and `AdminStore`) and its backends, chosen by `storage.url`."""

from __future__ import annotations

from ..config import StorageConfig
from .base import (
    Loaded,
    AdminStore,
    ChatKind,
    EndpointUsage,
    ItemsKind,
    KeptAnswer,
    MessageRecord,
    NewMessage,
    NewResponse,
    Postings,
    RecalledMessage,
    SearchHit,
    SentContext,
    SessionInfo,
    SessionState,
    Snapshot,
    Store,
    StoredCounts,
    StoredMessage,
    StoredResponse,
    Summary,
    SummaryCall,
    Totals,
    TurnInfo,
    TurnKind,
    TurnRecord,
    TurnStore,
    Usage,
    UsageTotals,
)
from .errors import StoreUnavailable
from .postgres import PostgresStore
from .sqlite import SQLiteStore

__all__ = [
    "Loaded",
    "AdminStore",
    "ChatKind",
    "EndpointUsage",
    "ItemsKind",
    "KeptAnswer",
    "MessageRecord",
    "SessionInfo",
    "UsageTotals",
    "NewMessage",
    "NewResponse",
    "Postings",
    "RecalledMessage",
    "SearchHit",
    "SentContext",
    "PostgresStore",
    "SQLiteStore",
    "SessionState",
    "Snapshot",
    "Store",
    "StoredCounts",
    "StoredMessage",
    "StoredResponse",
    "StoreUnavailable",
    "Summary",
    "SummaryCall",
    "Totals",
    "TurnInfo",
    "TurnKind",
    "TurnRecord",
    "TurnStore",
    "Usage",
    "apply_migrations",
    "open_store",
]


async def open_store(config: StorageConfig) -> Store:
    """The store `storage.url` names, migrated to the newest schema."""
    caches = {"history_cache_bytes": config.history_cache_mb << 20, "recall_cache_bytes": config.recall_cache_mb << 20}
    if config.is_postgres:
        return await PostgresStore.open(config, **caches)
    return await SQLiteStore.open(config.url, busy_timeout_ms=config.busy_timeout_ms, **caches)


async def apply_migrations(config: StorageConfig) -> None:
    """The store `storage.url` names brought to the newest schema (opening it does that), and closed."""
    store = await open_store(config)
    await store.close()
