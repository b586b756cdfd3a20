"""Shared fixtures: the fake provider, configs on temporary SQLite files, the proxy as a real server."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fake_upstream import FakeUpstream
from memproxy.app import create_app
from memproxy.config import ApiKey, AuthConfig, Config, MemoryConfig, ModelConfig, ServerConfig, StorageConfig

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROXY_KEY = "test-proxy-key-a"
OTHER_KEY = "test-proxy-key-b"


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[FakeUpstream]:
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


@pytest.fixture
def upstream(upstream_server: FakeUpstream) -> FakeUpstream:
    upstream_server.reset()
    return upstream_server


# The core tests see the plain sliding window; tests of summaries and compaction turn them on.
CORE_MEMORY: dict[str, Any] = {"summaries": False, "overflow": "drop", "tool_output_max_tokens": 0,
                               "dedupe_min_tokens": 0}


def make_config(db: Path, upstream_url: str, **memory: Any) -> Config:
    return Config(
        server=ServerConfig(host="127.0.0.1", port=0),
        storage=StorageConfig(url=f"sqlite:///{db}"),
        models=(
            ModelConfig(name="small", model="openai/small", api_base=upstream_url, api_key="upstream-secret",
                        context_window=2000, max_output_tokens=256),
            ModelConfig(name="big", model="openai/gpt-4o-mini", api_base=upstream_url,
                        api_key="upstream-secret", context_window=100_000, max_output_tokens=1000),
        ),
        memory=MemoryConfig(**{"summarizer_model": "small", "safety_margin_tokens": 20, **CORE_MEMORY,
                               **memory}),
        auth=AuthConfig(keys=(ApiKey(PROXY_KEY, "a"), ApiKey(OTHER_KEY, "b"))),
    )


@pytest.fixture
def config(tmp_path: Path, upstream: FakeUpstream) -> Config:
    return make_config(tmp_path / "memproxy.db", upstream.url)


class Proxy:
    def __init__(self, server: TestServer, app: web.Application) -> None:
        self.server = server
        self.app = app
        self.clients: list[openai.AsyncOpenAI] = []

    @property
    def url(self) -> str:
        return str(self.server.make_url("/v1"))

    def client(self, session: str | None = "s1", key: str = PROXY_KEY, **headers: str) -> openai.AsyncOpenAI:
        default_headers = dict(headers)
        if session is not None:
            default_headers["X-Session-Id"] = session
        client = openai.AsyncOpenAI(base_url=self.url, api_key=key, default_headers=default_headers,
                                    max_retries=0)
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        await self.server.close()


@pytest.fixture
async def start_proxy() -> AsyncIterator[Callable[[Config], Any]]:
    proxies: list[Proxy] = []

    async def start(config: Config) -> Proxy:
        app = create_app(config)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        proxies.append(Proxy(server, app))
        return proxies[-1]

    yield start
    for proxy in reversed(proxies):
        await proxy.close()


@pytest.fixture
async def proxy(start_proxy: Callable[[Config], Any], config: Config) -> Proxy:
    result: Proxy = await start_proxy(config)
    return result


def replace_model(config: Config, **changes: Any) -> Config:
    models = tuple(replace(m, **changes) if m.name == "small" else m for m in config.models)
    return replace(config, models=models)
