"""List cursors (issue 12, item 6): opaque, the caller's own, and exact, on SQLite and PostgreSQL.

A cursor must say nothing about other tenants (the store-wide row key it once carried counted every
tenant's sessions), must be refused when it comes from another listing, and must page exactly:
every session that existed when the walk began comes once, whatever is created meanwhile.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from db import execute
from memproxy.config import Config

pytestmark = pytest.mark.both_stores

ADMIN_KEY = "test-admin-key-c"


class Api:
    def __init__(self, http: aiohttp.ClientSession, proxy: Proxy) -> None:
        self.http, self.base = http, str(proxy.server.make_url("/v1"))

    async def call(self, method: str, path: str, key: str = PROXY_KEY, status: int = 200, **kwargs: Any) -> Any:
        async with self.http.request(method, self.base + path, headers={"Authorization": f"Bearer {key}"},
                                     **kwargs) as response:
            body = await response.json()
            assert response.status == status, body
            return body

    async def create(self, session: str, key: str = PROXY_KEY) -> None:
        await self.call("PUT", f"/sessions/{session}/metadata", key=key, json={"n": session})

    async def walk(self, limit: int, key: str = PROXY_KEY, query: str = "",
                   between: Callable[[int], Any] | None = None) -> list[str]:
        """Every page of the list, following `next`; `between(i)` runs before page i+1 is read."""
        seen: list[str] = []
        page = await self.call("GET", f"/sessions?limit={limit}{query}", key=key)
        pages = 0
        while True:
            seen += [s["id"] for s in page["data"]]
            if page["next"] is None:
                return seen
            if between is not None:
                await between(pages)
            pages += 1
            page = await self.call("GET", f"/sessions?limit={limit}{query}&after={page['next']}", key=key)


@pytest.fixture
async def api(start_proxy: Callable[[Config], Any], config: Config) -> AsyncIterator[Api]:
    auth = replace(config.auth, admin_keys=(ADMIN_KEY,))
    proxy = await start_proxy(replace(config, auth=auth))
    async with aiohttp.ClientSession() as http:
        yield Api(http, proxy)


def decoded(cursor: str) -> Any:
    return json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))


async def test_a_cursor_tells_nothing_of_other_tenants(api: Api) -> None:
    for i in range(3):
        await api.create(f"a{i}")
    first = await api.call("GET", "/sessions?limit=1")
    assert [s["id"] for s in first["data"]] == ["a2"]
    # The last session of the page, the tenant's own: its time, tenant and id, and nothing else.
    assert decoded(first["next"]) == [first["data"][0]["updated_at"], "a", "a2"]

    # Another tenant creating many sessions changes nothing in the first tenant's cursors or pages.
    for i in range(12):
        await api.create(f"b{i}", key=OTHER_KEY)
    again = await api.call("GET", "/sessions?limit=1")
    assert again == first
    assert await api.walk(1) == ["a2", "a1", "a0"]


async def test_a_cursor_from_another_listing_is_refused(api: Api, config: Config) -> None:
    for i in range(2):
        await api.create(f"a{i}")
        await api.create(f"b{i}", key=OTHER_KEY)
    cursor = (await api.call("GET", "/sessions?limit=1"))["next"]
    refused = [
        ("GET", f"/sessions?limit=1&after={cursor}", OTHER_KEY),  # tenant b, with a's cursor
        ("GET", f"/sessions?limit=1&tenant=b&after={cursor}", ADMIN_KEY),  # an admin listing b
        # Forged: another tenant's session named in a cursor, the old pk form, garbage, a non-id.
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[1.0,"b","b1"]').decode(), PROXY_KEY),
        ("GET", "/sessions?after=1795421167.14_14", PROXY_KEY),
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[1.0,"a","../x"]').decode(), PROXY_KEY),
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'["1.0","a","a1"]').decode(), PROXY_KEY),
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[1e400,"a","a1"]').decode(), PROXY_KEY),
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[' * 3000).decode(), PROXY_KEY),
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[1.0,"\\ud800","a1"]').decode(), ADMIN_KEY),
        # A NUL in the tenant: PostgreSQL refuses it as an error (a 503), not as no such tenant.
        ("GET", "/sessions?after=" + base64.urlsafe_b64encode(b'[1.0,"a\\u0000","a1"]').decode(), ADMIN_KEY),
        ("GET", "/sessions?after=%C3%A9", PROXY_KEY),
    ]
    for method, path, key in refused:
        body = await api.call(method, path, key=key, status=400)
        assert body["error"]["param"] == "after", (path, body)
    # The same cursor serves the listing it came from, and an admin listing of that tenant.
    assert [s["id"] for s in (await api.call("GET", f"/sessions?limit=5&after={cursor}"))["data"]] == ["a0"]
    assert [s["id"] for s in (await api.call("GET", f"/sessions?limit=5&tenant=a&after={cursor}",
                                             key=ADMIN_KEY))["data"]] == ["a0"]


async def test_pages_are_exact_while_sessions_are_created(api: Api, config: Config) -> None:
    existing = [f"a{i:02}" for i in range(9)]
    for session in existing:
        await api.create(session)
    created: list[str] = []

    async def create_more(page: int) -> None:
        for tenant_key, prefix in ((PROXY_KEY, "new"), (OTHER_KEY, "other")):
            created.append(f"{prefix}{page}")
            await api.create(created[-1], key=tenant_key)

    # New sessions are newer than every cursor: the walk shows each old one once, and no new one.
    assert await api.walk(2, between=create_more) == existing[::-1]
    assert created  # the walk did run while sessions were created

    # Sessions sharing one time still come once each, in a stable order, on every page size; an
    # admin listing of every tenant walks both tenants' sessions the same way.
    execute(config, "UPDATE sessions SET updated_at = 1700000000.25")
    everything = await api.walk(100, key=ADMIN_KEY)
    for limit in (1, 2, 3):
        assert await api.walk(limit, key=ADMIN_KEY) == everything
        assert await api.walk(limit) == [s for s in everything if s.startswith(("a", "new"))]
    assert len(everything) == len(set(everything)) == len(existing) + len(created)


async def test_a_walk_survives_the_deletion_of_its_cursor_session(api: Api) -> None:
    for i in range(5):
        await api.create(f"a{i}")
    page = await api.call("GET", "/sessions?limit=2")
    assert [s["id"] for s in page["data"]] == ["a4", "a3"]
    await api.call("DELETE", "/sessions/a3")
    rest = await api.call("GET", f"/sessions?limit=10&after={page['next']}")
    assert [s["id"] for s in rest["data"]] == ["a2", "a1", "a0"]  # resumed after its time: nothing skipped
