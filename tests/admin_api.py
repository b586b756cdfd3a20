"""What the tests of the session admin API share: a proxy with an admin key, an API client, the store.

`start` runs a proxy on the test's store with `ADMIN_KEY` as its admin key; `Api` makes `/v1/...`
requests with one key, asserting the status; the functions under "the store" read (and, where a test
needs an old session, write) the database from a second connection. The `http` client session is a
fixture of conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from conftest import PROXY_KEY, Proxy, make_config
from db import rows, table_query
from fake_upstream import FakeUpstream, Received, Reply
from helpers import user
from memproxy.config import Config, RetentionConfig, StorageConfig
from memproxy.store.sqlite import sqlite_path
from memproxy.typedefs import CONFIG

Message = dict[str, Any]
StartProxy = Callable[[Config], Any]
MakeStorage = Callable[..., StorageConfig]

ADMIN_KEY = "admin-key-123"
SYSTEM: Message = {"role": "system", "content": "You are terse."}
TABLES = ("sessions", "turns", "messages", "summaries")
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}


def words(n: int, tag: str) -> str:
    """About n tokens of text, distinct per tag."""
    return " ".join(f"{tag}{i % 10}" for i in range(n))


def short_summary(received: Received) -> Reply:
    return Reply(content="The user asked several questions; all were answered.")


# --- the proxy and the admin client -------------------------------------------------------------


async def start(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
    retention: RetentionConfig | None = None, db: str = "memproxy", **memory: Any,
) -> Proxy:
    config = make_config(make_storage(db), upstream.url, **memory)
    config = replace(config, auth=replace(config.auth, admin_keys=(ADMIN_KEY,)),
                     retention=retention or RetentionConfig())
    proxy: Proxy = await start_proxy(config)
    return proxy


@dataclass
class Api:
    """`/v1/...` requests with one key; each asserts its status and returns the decoded body."""

    http: aiohttp.ClientSession
    proxy: Proxy
    key: str = PROXY_KEY

    def as_(self, key: str) -> Api:
        return Api(self.http, self.proxy, key)

    async def call(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.key}"}
        async with self.http.request(method, f"{self.proxy.url}{path}", headers=headers, **kwargs) as response:
            text = await response.text()
            assert response.status == status, f"{method} {path}: {response.status} {text}"
            if response.content_type == "application/json":
                return json.loads(text)
            return text

    async def get(self, path: str, status: int = 200, **kwargs: Any) -> Any:
        return await self.call("GET", path, status, **kwargs)

    async def post(self, path: str, status: int = 200, **kwargs: Any) -> Any:
        return await self.call("POST", path, status, **kwargs)


def api_for(http: aiohttp.ClientSession, proxy: Proxy) -> Api:
    return Api(http, proxy)


async def preview_of(api: Api, session: str, text: str, **body: Any) -> Any:
    """What the next request of `session` would send with the new user message `text` (in a POST
    body: content never goes in a URL)."""
    return await api.post(f"/sessions/{session}/context", json={"messages": [user(text)], **body})


def part(preview: Any, name: str) -> Any:
    """One labelled part of a context preview."""
    return next(p for p in preview["parts"] if p["part"] == name)


def assert_error(body: Any, *, type: str, code: str | None = None, param: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param


# --- the store, from a second connection ---------------------------------------------------------


def config_of(proxy: Proxy) -> Config:
    return proxy.app[CONFIG]


def session_pk(config: Config, session: str, tenant: str = "a") -> int | None:
    found = rows(config, "SELECT pk FROM sessions WHERE tenant = ? AND session_id = ?", tenant, session)
    return int(found[0][0]) if found else None


def rows_of(config: Config, pk: int) -> dict[str, int]:
    queries = [("SELECT count(*) FROM sessions WHERE pk = ?", (pk,))]
    queries += [(f"SELECT count(*) FROM {table} WHERE session_pk = ?", (pk,)) for table in TABLES[1:]]
    return {table: found[0][0] for table, found in zip(TABLES, table_query(config, queries))}


def stored_bodies(config: Config, session: str, tenant: str = "a") -> list[Message]:
    found = rows(config, "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                         " WHERE s.tenant = ? AND s.session_id = ? ORDER BY m.id", tenant, session)
    return [json.loads(r[0]) for r in found]


def write_db(config: Config, sql: str, *params: Any) -> int:
    """One write from a second connection (`tests/db.py` reads only); returns the rows changed."""
    if config.storage.is_postgres:
        return len(rows(config, f"{sql} RETURNING 1", *params))
    with closing(sqlite3.connect(sqlite_path(config.storage.url), timeout=5)) as db:
        changed = db.execute(sql, params).rowcount
        db.commit()
        return changed


async def age(config: Config, session: str, seconds: float, tenant: str = "a") -> None:
    """Make a session look idle for `seconds` by moving its last activity into the past. On a
    thread: the proxy's own writes (a sweep) need the event loop to finish theirs meanwhile."""
    changed = await asyncio.to_thread(
        write_db, config, "UPDATE sessions SET updated_at = updated_at - ? WHERE tenant = ? AND session_id = ?",
        seconds, tenant, session)
    assert changed == 1


# --- used by tests of several concerns ----------------------------------------------------------


def tool_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": '{"q": "x"}'}}


def with_tenant(path: str, tenant: str) -> str:
    return f"{path}{'&' if '?' in path else '?'}tenant={tenant}"


async def snapshot(api: Api, session: str, tenant: str | None = None) -> tuple[Any, Any]:
    """Everything the API says about a session: its detail and its export."""
    admin = api.as_(ADMIN_KEY)
    tenant = tenant or "a"
    return (await admin.get(with_tenant(f"/sessions/{session}", tenant)),
            await admin.get(with_tenant(f"/sessions/{session}/export", tenant)))


NOTHING_DELETED = {"sessions": 0, "turns": 0, "summary_calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                   "cost": None, "context_tokens": 0, "full_history_tokens": 0, "tokens_saved": 0}
