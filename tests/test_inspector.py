"""The web inspector at /ui/, driven in a real browser (Debian's headless Chromium, through selenium
and the chromedriver of the same package).

One proxy serves the whole module, on 127.0.0.1 in a thread of its own (so selenium's blocking calls
and the server never share an event loop). Its sessions are made by real turns through the openai
SDK against the fake provider: a session whose messages and metadata carry an HTML/script payload, one
with a tool call and its result, one with an edit (a superseded branch), one long enough on a small
window to be summarised and to leave messages out, and one of another tenant. Every wait is on an
element (WebDriverWait), never a sleep. A script added before every page records alert/confirm/prompt
calls and Content-Security-Policy violations, and the tests assert there were none.

With MEMPROXY_SCREENSHOTS=1 the tests write a screenshot of each page into docs/ (inspector-*.png).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from admin_api import ADMIN_KEY, SYSTEM, short_summary, tool_call, words
from browser import ServedProxy, chromium
from conftest import OTHER_KEY, PROXY_KEY, make_config
from fake_upstream import FakeUpstream, Reply
from helpers import user
from memproxy.app import create_app
from memproxy.inspector import CSP
from memproxy.typedefs import SUMMARIZER

XSS = "<script>alert(1)</script><img src=x onerror=alert(2)>"
PICTURE = "data:image/png;base64," + base64.b64encode(bytes(300 * 1024)).decode()  # 300 KB inline
REFUSAL = "I cannot describe people in pictures."
DOCS = Path(__file__).resolve().parent.parent / "docs"
WAIT = 15.0


def converse(proxy: ServedProxy, upstream: FakeUpstream) -> None:
    """The sessions the inspector shows, made by real turns."""
    def turn(client: openai.OpenAI, messages: list[dict[str, Any]], reply: Reply | None = None) -> None:
        if reply:
            upstream.enqueue(reply)
        sent: Any = messages
        client.chat.completions.create(model="small", messages=sent)

    with proxy.client("xss") as c:
        turn(c, [SYSTEM, user(XSS)], Reply(content="You wrote " + XSS))
        turn(c, [user([{"type": "text", "text": "What is in this picture?"},
                       {"type": "image_url", "image_url": {"url": PICTURE}}])], Reply(refusal=REFUSAL))
    httpx.put(proxy.url + "/v1/sessions/xss/metadata", json={"note": XSS},
              headers={"Authorization": f"Bearer {PROXY_KEY}"}).raise_for_status()

    with proxy.client("tools") as c:
        turn(c, [SYSTEM, user("look up the lighthouse keeper")], Reply(tool_calls=[tool_call("call_1", "search")]))
        turn(c, [{"role": "tool", "tool_call_id": "call_1", "content": "The keeper was Ada Lovelace."}],
             Reply(content="The keeper was Ada."))

    with proxy.client("edited") as c:  # a client that resends the history, then edits its last question
        history = [SYSTEM, user("What is the capital of France?")]
        turn(c, history, Reply(content="Paris."))
        history += [{"role": "assistant", "content": "Paris."}, user("And of Italy?")]
        turn(c, history, Reply(content="Rome."))
        turn(c, history[:-1] + [user("And of Spain?")], Reply(content="Madrid."))

    with proxy.client("long") as c:  # a client that sends only its new messages
        for i in range(6):
            turn(c, ([SYSTEM] if i == 0 else []) + [user(f"turn {i}: " + words(150, f"w{i}"))])
        proxy.run(proxy.app[SUMMARIZER].wait_idle())
        turn(c, [user("what did I say about w00 and w01?")])  # recall sends turn 0 again

    with proxy.client("elsewhere", key=OTHER_KEY) as c:
        turn(c, [user("tenant b's own question")])


@pytest.fixture(scope="module")
def proxy(upstream_server: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProxy]:
    upstream_server.reset()
    upstream_server.summarizer = short_summary
    config = make_config(tmp_path_factory.mktemp("inspector") / "memproxy.db", upstream_server.url,
                         summaries=True, overflow="summarize", chunk_threshold_tokens=400, tail_turns=1,
                         recall_tokens=None)
    config = replace(config, auth=replace(config.auth, admin_keys=(ADMIN_KEY,)))
    served = ServedProxy(create_app(config)).start()
    try:
        converse(served, upstream_server)
        yield served
    finally:
        served.stop()
        upstream_server.reset()


# --- the pages, without a browser -----------------------------------------------------------------


def test_pages_need_no_key_and_carry_a_strict_policy(proxy: ServedProxy) -> None:
    for path, kind in [("/ui/", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")]:
        response = httpx.get(proxy.url + path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == f"{kind}; charset=utf-8"
        assert response.headers["content-security-policy"] == CSP
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    page = httpx.get(proxy.url + "/ui/").text
    assert "<script src=" in page and "<style" not in page and " style=" not in page  # nothing inline
    redirect = httpx.get(proxy.url + "/ui")
    assert redirect.status_code == 302 and redirect.headers["location"] == "ui/"
    assert httpx.get(proxy.url + "/ui/../v1/sessions").status_code == 401  # the data still needs a key
    missing = httpx.get(proxy.url + "/ui/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_serving_the_pages_does_not_import_litellm() -> None:
    script = (
        "import asyncio, sys\n"
        "from aiohttp import web\n"
        "from aiohttp.test_utils import TestClient, TestServer\n"
        "from memproxy.inspector import add_routes\n"
        "async def main():\n"
        "    app = web.Application(); add_routes(app)\n"
        "    async with TestClient(TestServer(app, host='127.0.0.1')) as client:\n"
        "        assert (await client.get('/ui/app.js')).status == 200\n"
        "asyncio.run(main())\n"
        "print('litellm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


# --- the browser ----------------------------------------------------------------------------------


# Before every page: record dialogs and policy violations where the test can read them.
WATCH = """
window.__dialogs = []; window.__violations = [];
for (const name of ["alert", "confirm", "prompt"]) window[name] = (...a) => { window.__dialogs.push([name, ...a]); };
document.addEventListener("securitypolicyviolation", (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium(WATCH) as driver:
        yield driver


class Page:
    """The browser on the inspector, with the waits the tests use."""

    def __init__(self, driver: Any, proxy: ServedProxy) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.proxy, self.by, self.ec = driver, proxy, By, expected_conditions
        self.wait = WebDriverWait(driver, WAIT)

    def open(self, hash: str = "#/") -> None:
        self.driver.get(f"{self.proxy.url}/ui/{hash}")

    def element(self, css: str) -> Any:
        return self.wait.until(self.ec.visibility_of_element_located((self.by.CSS_SELECTOR, css)))

    def elements(self, css: str) -> list[Any]:
        return list(self.driver.find_elements(self.by.CSS_SELECTOR, css))

    def text_appears(self, css: str, text: str) -> None:
        self.wait.until(self.ec.text_to_be_present_in_element((self.by.CSS_SELECTOR, css), text))

    def click(self, text: str) -> None:
        self.wait.until(self.ec.element_to_be_clickable((self.by.LINK_TEXT, text))).click()

    def sign_in(self, key: str, refused: bool = False) -> None:
        """Sign in afresh; then wait for the list (or for the refusal)."""
        self.open()
        self.driver.execute_script("sessionStorage.clear()")
        self.driver.refresh()
        self.element("#key").send_keys(key)
        self.screenshot("signin")
        self.element("#signin button").click()
        self.element(".error" if refused else "#sessions tbody tr")

    def clean(self) -> None:
        """No dialog was opened and the policy refused nothing on this page."""
        assert self.driver.execute_script("return window.__dialogs") == []
        assert self.driver.execute_script("return window.__violations") == []

    def screenshot(self, name: str) -> None:
        """docs/inspector-NAME.png, of the page's top 1,500 pixels (with MEMPROXY_SCREENSHOTS=1)."""
        if os.environ.get("MEMPROXY_SCREENSHOTS") != "1":
            return
        height = self.driver.execute_script("window.scrollTo(0, 0); return document.documentElement.scrollHeight")
        self.driver.set_window_size(1280, min(max(height, 700), 1500))
        try:
            self.driver.save_screenshot(str(DOCS / f"inspector-{name}.png"))
        finally:
            self.driver.set_window_size(1280, 900)


@pytest.fixture
def page(browser: Any, proxy: ServedProxy) -> Page:
    return Page(browser, proxy)


def test_a_wrong_key_is_refused_and_shows_nothing(page: Page) -> None:
    page.sign_in("not-a-key", refused=True)
    page.text_appears(".error", "Incorrect API key provided.")
    assert not page.elements("#signout")[0].is_displayed()  # nobody is signed in
    assert page.elements("#sessions") == [] and page.element("#key").get_attribute("value") == ""
    assert page.driver.execute_script("return sessionStorage.getItem('memproxy.key')") is None
    page.open("#/session/a/xss")  # a page of data, asked for without a key: the sign-in form
    page.element("#key")
    assert "lighthouse" not in page.driver.page_source and page.elements(".msg") == []
    page.clean()


def test_sign_in_lists_the_tenants_sessions_with_usage(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.element("#sessions tbody tr")
    page.text_appears("#who", "tenant a")
    ids = [a.text for a in page.elements("#sessions tbody td:first-child a")]
    assert ids == ["long", "edited", "tools", "xss"]  # newest activity first; tenant b's is not there
    page.text_appears(".card .facts", "turns")
    page.screenshot("sessions")
    page.element("#filter").send_keys("edit")
    page.wait.until(lambda _: len(page.elements("#sessions tbody tr")) == 1)
    page.element("#query").send_keys("lighthouse keeper\n")
    page.text_appears("#hits", "look up the lighthouse keeper")
    page.clean()


def test_a_session_reads_as_a_conversation(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.click("tools")
    page.text_appears("#conversation", "→ search")
    page.text_appears("#conversation", "result of call_1")
    assert '"q": "x"' in page.element("#conversation .call pre").text
    page.screenshot("tools")
    page.open("#/session/a/edited")
    branch = page.element("#conversation details.branch")
    assert "And of Italy?" not in branch.text  # folded away ...
    branch.click()
    page.text_appears("#conversation details.branch", "And of Italy?")  # ... and reachable
    assert "And of Spain?" in page.element("#conversation").text
    page.screenshot("branch")
    page.open("#/session/a/long")
    page.text_appears("details.summary", "Summary v")
    page.text_appears("#conversation", "in summary")
    page.screenshot("session")
    page.clean()


def test_a_turn_shows_what_was_sent_and_why(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.open("#/session/a/long")
    marks = [m for m in page.wait.until(lambda _: page.elements(".turn-mark"))]
    last = marks[-1]
    last.find_element(page.by.LINK_TEXT, "what was sent").click()
    sent = page.element("#sent").text
    assert "summary sent\nv" in sent, sent
    assert "left out" in sent and "recalled\nlong #0" in sent, sent
    page.text_appears(".recalled", "turn 0: w00 w01")
    page.element("details.left-out")
    page.text_appears("details.summary", "The user asked several questions")
    page.screenshot("turn")
    page.clean()


def test_the_next_request_preview(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.open("#/session/a/long")
    page.click("Preview the next request →")
    page.text_appears("#parts", "left out")
    parts = [row.find_element(page.by.CSS_SELECTOR, "td").text for row in page.elements("#parts tbody tr")]
    assert parts[0] == "system" and "summary" in parts and "kept" in parts
    assert page.elements("#sent-messages .msg")
    page.screenshot("context")
    page.clean()


def test_html_in_content_is_shown_as_text(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.text_appears("#sessions", XSS)  # the title, as text
    page.open("#/session/a/xss")
    page.text_appears("#conversation", "You wrote " + XSS)
    contents = [c.text for c in page.elements("#conversation .content")]
    assert XSS in contents
    metadata = page.elements("details.card pre")  # folded: read, not seen
    assert len(metadata) == 1 and XSS in metadata[0].get_attribute("textContent")
    assert page.elements("main script, main img") == []
    assert page.driver.execute_script("return document.querySelectorAll('img[src=x]').length") == 0
    page.clean()


def test_media_shows_in_a_few_words_and_a_refusal_as_what_it_said(page: Page) -> None:
    page.sign_in(PROXY_KEY)
    page.open("#/session/a/xss")
    page.text_appears("#conversation", "[image, 300 KB inline]")
    page.text_appears("#conversation", "[refused] " + REFUSAL)
    assert PICTURE[22:2000] not in page.driver.page_source  # megabytes of a photo are not put on the page
    page.clean()


def test_an_admin_key_sees_every_tenant(page: Page) -> None:
    page.sign_in(ADMIN_KEY)
    page.text_appears("#who", "admin")
    page.text_appears("#sessions", "elsewhere")
    page.text_appears("#tenants", "b")
    page.click("elsewhere")
    page.text_appears("#conversation", "tenant b's own question")
    page.clean()
