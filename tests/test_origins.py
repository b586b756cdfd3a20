"""Web pages and memproxy (`memproxy.origins`): what a browser may do, against the real server.

Over plain HTTP, as a browser would send it: a page of an origin not allowed is refused before its
request is read or forwarded (a `text/plain` POST needs no preflight, so the browser would send it);
the inspector's own requests (same origin) pass; with no keys, a Host that is not this machine's (DNS
rebinding) is refused; an allowed origin gets CORS preflights and headers, on plain and streamed
answers. Then in headless Chromium: a page of an allowed origin holds a conversation with memory
through `fetch`, one of another origin can neither read an answer nor make one happen.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from browser import ServedProxy, chromium
from conftest import PROXY_KEY, Proxy, make_config
from fake_upstream import FakeUpstream, Reply
from memproxy.app import create_app
from memproxy.config import AuthConfig, Config, ConfigError, parse_config

APP = "http://app.example"
EVIL = "http://evil.example"
CHAT = {"model": "small", "messages": [{"role": "user", "content": "remember the number 41"}]}


def keyless(config: Config, **server: Any) -> Config:
    return replace(config, auth=AuthConfig(), server=replace(config.server, **server))


def with_origins(config: Config, *origins: str) -> Config:
    return replace(config, server=replace(config.server, cors_origins=origins))


def host_of(proxy: Proxy) -> str:
    return f"127.0.0.1:{proxy.server.port}"


async def sessions(http: aiohttp.ClientSession, proxy: Proxy, key: str | None = PROXY_KEY) -> list[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.get(f"{proxy.url}/sessions", headers=headers) as response:
        assert response.status == 200
        return [s["id"] for s in (await response.json())["data"]]


def assert_refused(status: int, body: dict[str, Any], code: str) -> None:
    assert status == 403
    assert body["error"]["type"] == "permission_error" and body["error"]["code"] == code
    assert set(body["error"]) == {"message", "type", "code", "param"}


# --- origins --------------------------------------------------------------------------------------


async def test_a_page_of_another_origin_changes_nothing(start_proxy: Any, config: Config, upstream: FakeUpstream,
                                                         http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(keyless(config))
    # A page's "simple" request: text/plain, no custom header, so no preflight; the browser sends it.
    async with http.post(f"{proxy.url}/chat/completions", data=json.dumps(CHAT),
                         headers={"Origin": EVIL, "Content-Type": "text/plain"}) as response:
        assert_refused(response.status, await response.json(), "origin_not_allowed")
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT,
                         headers={"Origin": EVIL, "X-Session-Id": "s1"}) as response:
        assert_refused(response.status, await response.json(), "origin_not_allowed")
    assert upstream.chat_requests() == []  # nothing spent upstream
    assert await sessions(http, proxy, key=None) == []  # nothing stored

    # A session made by a local client: a page cannot delete or clear it.
    upstream.enqueue(Reply(content="Noted."))
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers={"X-Session-Id": "s1"}) as response:
        assert response.status == 200
    for method, path in [("DELETE", "/sessions/s1"), ("POST", "/sessions/s1/clear")]:
        async with http.request(method, proxy.url + path, headers={"Origin": EVIL}) as response:
            assert_refused(response.status, await response.json(), "origin_not_allowed")
    async with http.get(f"{proxy.url}/sessions/s1") as response:
        stored = (await response.json())["messages"]
        assert [m["message"]["content"] for m in stored] == ["remember the number 41", "Noted."]


async def test_the_proxys_own_pages_and_clients_without_an_origin_pass(
        start_proxy: Any, config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(keyless(config))
    for origin in (f"http://{host_of(proxy)}", f"https://{host_of(proxy)}"):  # the scheme: TLS ended before it
        upstream.enqueue(Reply(content="Noted."))
        async with http.post(f"{proxy.url}/chat/completions", json=CHAT,
                             headers={"Origin": origin, "X-Session-Id": "s1"}) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers  # same origin: no CORS needed
    upstream.enqueue(Reply(content="Noted."))
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers={"X-Session-Id": "s2"}) as response:
        assert response.status == 200
    assert len(upstream.chat_requests()) == 3


async def test_an_allowed_origin_gets_cors_on_every_kind_of_answer(
        start_proxy: Any, config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(with_origins(config, APP.upper()))  # origins compare in lower case
    requested = "authorization,content-type,x-session-id,x-stainless-lang,openai-organization"
    async with http.options(f"{proxy.url}/chat/completions", headers={
            "Origin": APP, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": requested}) as response:  # a preflight carries no key
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == APP
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        allowed = {h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
        assert set(requested.split(",")) <= allowed
        assert "Access-Control-Allow-Credentials" not in response.headers
    async with http.options(f"{proxy.url}/chat/completions", headers={
            "Origin": EVIL, "Access-Control-Request-Method": "POST"}) as response:
        assert_refused(response.status, await response.json(), "origin_not_allowed")

    headers = {"Origin": APP, "Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
    upstream.enqueue(Reply(content="Noted."))
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == APP
        exposed = {h.strip().lower() for h in response.headers["Access-Control-Expose-Headers"].split(",")}
        assert {"x-session-id", "x-memproxy-reconcile"} <= exposed  # a page reads memproxy's headers
    upstream.enqueue(Reply(content="You said 41."))
    async with http.post(f"{proxy.url}/chat/completions", json={**CHAT, "stream": True}, headers=headers) as response:
        assert response.status == 200 and response.headers["Access-Control-Allow-Origin"] == APP
        assert (await response.text()).rstrip().endswith("data: [DONE]")
    async with http.post(f"{proxy.url}/chat/completions", json={**CHAT, "model": "nope"},
                         headers=headers) as response:  # an error a page must be able to read
        assert response.status == 404 and response.headers["Access-Control-Allow-Origin"] == APP
        assert (await response.json())["error"]["code"] == "model_not_found"
    async with http.get(f"{proxy.url}/models", headers={"Origin": APP}) as response:  # no key: a 401 it can read
        assert response.status == 401 and response.headers["Access-Control-Allow-Origin"] == APP


async def test_no_answer_may_be_cached_or_sniffed(start_proxy: Any, config: Config, upstream: FakeUpstream,
                                                  http: aiohttp.ClientSession) -> None:
    """Conversations, sessions and errors are the caller's own: no cache keeps them and no browser
    reads them as another type; the inspector's pages and event streams keep their own policy."""
    proxy = await start_proxy(config)
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    upstream.enqueue(Reply(content="Noted."), Reply(content="You said 41."))
    answers = []
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers={**auth, "X-Session-Id": "s1"}) as r:
        answers.append((r.status, r.headers))
    async with http.get(f"{proxy.url}/sessions/s1", headers=auth) as r:
        answers.append((r.status, r.headers))
    async with http.get(f"{proxy.url}/sessions/nope", headers=auth) as r:
        answers.append((r.status, r.headers))
    async with http.get(f"{proxy.url}/models") as r:  # no key
        answers.append((r.status, r.headers))
    assert [status for status, _ in answers] == [200, 200, 404, 401]
    for _, headers in answers:
        assert headers["Cache-Control"] == "no-store" and headers["X-Content-Type-Options"] == "nosniff"
    async with http.post(f"{proxy.url}/chat/completions", json={**CHAT, "stream": True},
                         headers={**auth, "X-Session-Id": "s1"}) as r:
        assert r.status == 200 and r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "no-cache"  # as OpenAI's streams say
        assert (await r.text()).rstrip().endswith("data: [DONE]")
    async with http.get(f"{proxy.url.removesuffix('/v1')}/ui/") as r:
        assert r.status == 200 and r.headers["Cache-Control"] == "no-cache"  # fetched again, never mixed


async def test_any_origin_where_star_is_listed(start_proxy: Any, config: Config, upstream: FakeUpstream,
                                               http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(with_origins(config, "*"))  # with keys: a page still needs one
    headers = {"Origin": EVIL, "Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
    upstream.enqueue(Reply(content="Noted."))
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers=headers) as response:
        assert response.status == 200 and response.headers["Access-Control-Allow-Origin"] == EVIL
    async with http.post(f"{proxy.url}/chat/completions", json=CHAT, headers={"Origin": EVIL}) as response:
        assert response.status == 401 and response.headers["Access-Control-Allow-Origin"] == EVIL


# --- hosts ----------------------------------------------------------------------------------------


async def test_without_keys_only_this_machines_names_are_answered(
        start_proxy: Any, config: Config, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(keyless(config, allowed_hosts=("memproxy.internal",)))
    port = proxy.server.port
    # DNS rebinding: the attacker's domain now resolves here, so its page is "same origin".
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        async with http.get(f"{proxy.url}/sessions", headers={"Host": host, "Origin": f"http://{host}"}) as response:
            assert_refused(response.status, await response.json(), "host_not_allowed")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"app.localhost:{port}",
                 f"memproxy.internal:{port}", "MEMPROXY.internal", f"10.0.0.5:{port}"):
        async with http.get(f"{proxy.url}/sessions", headers={"Host": host}) as response:
            assert response.status == 200, host


async def test_with_keys_any_host_is_answered(start_proxy: Any, config: Config, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(config)  # a page cannot add the key: a rebinding host gains nothing
    headers = {"Host": f"memproxy.example.com:{proxy.server.port}"}
    async with http.get(f"{proxy.url}/sessions", headers=headers) as response:
        assert response.status == 401
    async with http.get(f"{proxy.url}/sessions", headers={**headers, "Authorization": f"Bearer {PROXY_KEY}"}) as response:
        assert response.status == 200


# --- config ---------------------------------------------------------------------------------------


def test_the_settings_are_checked() -> None:
    models = "models:\n  - {name: m, model: openai/m, context_window: 8000}\n"
    keys = "auth:\n  keys:\n    - {key: secret-key-1, tenant: a}\n"
    config = parse_config(models + "server:\n  cors_origins: ['HTTPS://App.Example.com', 'http://localhost:5173']\n")
    assert config.server.cors_origins == ("https://app.example.com", "http://localhost:5173")
    assert parse_config(models + keys + "server:\n  cors_origins: ['*']\n").server.cors_origins == ("*",)
    with pytest.raises(ConfigError, match="server.cors_origins.*keys"):
        parse_config(models + "server:\n  cors_origins: ['*']\n")
    for bad in ("https://app.example.com/", "app.example.com", "null", "https://app.example.com/path"):
        with pytest.raises(ConfigError, match="cors_origins"):
            parse_config(models + f"server:\n  cors_origins: ['{bad}']\n")
    with pytest.raises(ConfigError, match="allowed_hosts"):
        parse_config(models + "server:\n  allowed_hosts: ['host:8080']\n")


# --- a real browser -------------------------------------------------------------------------------

CONVERSE = """
const [proxy, key, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
const headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json", "X-Session-Id": "browser"};
const ask = (content, stream) => fetch(proxy + "/v1/chat/completions", {method: "POST", headers,
    body: JSON.stringify({model: "small", stream, messages: [{role: "user", content}]})});
(async () => {
  const first = await ask("remember the number 41", false);
  const body = await first.json();
  const second = await ask("which number?", true);
  const text = await second.text();
  done({first: body.choices[0].message.content, session: first.headers.get("X-Session-Id"),
        stream: text.includes("data: [DONE]"), second: second.status});
})().catch((e) => done({error: String(e)}));
"""

FORBIDDEN = """
const [proxy, done] = [arguments[0], arguments[arguments.length - 1]];
(async () => {
  let read;
  try {
    await fetch(proxy + "/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json",
        "X-Session-Id": "evil"}, body: JSON.stringify({model: "small", messages: [{role: "user", content: "hi"}]})});
    read = "read";
  } catch (e) { read = "blocked"; }
  // The request a page can always send, blind: no preflight, an opaque answer.
  await fetch(proxy + "/v1/chat/completions", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
      body: JSON.stringify({model: "small", messages: [{role: "user", content: "spend their key"}]})});
  done({read});
})().catch((e) => done({error: String(e)}));
"""


async def empty_page(request: web.Request) -> web.Response:
    return web.Response(text="<!doctype html><title>app</title>", content_type="text/html")


class Site:
    """A page's own origin: an empty HTML page on a port of its own."""

    def __init__(self) -> None:
        app = web.Application()
        app.router.add_get("/", empty_page)
        self.served = ServedProxy(app).start()

    @property
    def origin(self) -> str:
        return self.served.url


@pytest.fixture(scope="module")
def sites() -> Iterator[tuple[Site, Site]]:
    allowed, other = Site(), Site()
    try:
        yield allowed, other
    finally:
        allowed.served.stop()
        other.served.stop()


def test_a_browser_page_holds_a_conversation_only_from_an_allowed_origin(
        upstream_server: FakeUpstream, tmp_path: Path, sites: tuple[Site, Site]) -> None:
    allowed, other = sites
    with chromium() as driver:
        upstream_server.reset()
        # A local daemon (no keys): the case where a page of another origin would otherwise be answered.
        config = keyless(with_origins(make_config(tmp_path / "memproxy.db", upstream_server.url), allowed.origin))
        proxy = ServedProxy(create_app(config)).start()
        try:
            upstream_server.enqueue(Reply(content="Noted: 41."), Reply(content="It was 41."))
            driver.get(allowed.origin + "/")
            result = driver.execute_async_script(CONVERSE, proxy.url, PROXY_KEY)
            assert result == {"first": "Noted: 41.", "session": "browser", "stream": True, "second": 200}
            sent = upstream_server.chat_requests()[-1].body["messages"]
            assert [m["content"] for m in sent] == ["remember the number 41", "Noted: 41.", "which number?"]

            before = len(upstream_server.chat_requests())
            driver.get(other.origin + "/")
            assert driver.execute_async_script(FORBIDDEN, proxy.url) == {"read": "blocked"}
            assert len(upstream_server.chat_requests()) == before  # nothing forwarded, nothing spent
        finally:
            proxy.stop()
            upstream_server.reset()
