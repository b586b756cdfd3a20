"""Real browsers in tests: Debian's headless Chromium through selenium (installed when missing, so a
fresh machine's CI runs these tests), and the real app served on a thread of its own, so selenium's
blocking calls and the server never share an event loop."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from aiohttp import web

from conftest import PROXY_KEY

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class ServedProxy:
    """The real app on a real port, its event loop on a thread, for a synchronous test module."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inspector-proxy", daemon=True)
        self.runner = web.AppRunner(app)
        self.port = 0

    def run(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> ServedProxy:
        self.thread.start()
        self.run(self._start())
        return self

    def stop(self) -> None:
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, session: str, key: str = PROXY_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             default_headers={"X-Session-Id": session})



def chromium_available() -> str | None:
    """Installs Debian's chromium and its driver when missing (so a fresh machine's CI runs these
    tests); the reason when that cannot be done."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "Debian's chromium is not installed and apt-get cannot install it here (not root or no apt)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            return f"'{' '.join(command)}' failed: {done.stderr.strip()[-500:]}"
    return None


@contextmanager
def chromium(init_script: str | None = None) -> Iterator[Any]:
    """A headless Chromium (skipping the test, with the reason printed, where none can be had);
    `init_script` runs before every page."""
    reason = chromium_available()
    if reason:
        print(f"browser tests not run: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                     "--disable-gpu", "--lang=en-US"):
        options.add_argument(argument)
    # The driver named explicitly: selenium-manager (which downloads drivers) never runs.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    if init_script:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": init_script})
    try:
        yield driver
    finally:
        driver.quit()
