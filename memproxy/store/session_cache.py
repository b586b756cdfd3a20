"""What a store keeps of recently used sessions between calls, within a byte budget.

One least-recently-used map by (tenant, session id) for both of the store's caches: the decoded
history (`memproxy.store.history_cache`) and recall's index (`memproxy.store.recall_index`). Each
value is put with its estimated size; past the budget the least recently used go first, and a value
larger than the whole budget is not kept (a budget of 0 keeps nothing: the cache is off).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")
Key = tuple[str, str]  # (tenant, session id)


class SessionCache(Generic[V]):
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[Key, tuple[V, int]] = OrderedDict()  # value, its cost when put

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Key, value: V, cost: int) -> None:
        """Keep `value` at `cost` bytes, in place of what `key` held (a value grown in place is put
        again with its new cost)."""
        self.discard(key)
        if cost > self.budget:
            return
        self._entries[key] = (value, cost)
        self.used += cost
        while self.used > self.budget:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used -= evicted

    def discard(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry[1]
