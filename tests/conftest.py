"""Shared fixtures: the fake provider, configs on a store of the test's own, the proxy as a real server.

Which store: a module that opts in with `pytestmark = pytest.mark.both_stores` runs each of its tests
that uses `store_kind` (through `config`, `storage`, `make_storage`) once on SQLite and once on
PostgreSQL (a fresh schema per test, dropped afterwards; skipped outside CI when PostgreSQL cannot be
reached). Every other module stays on SQLite. Read what a proxy stored through `tests/db.py`.

Which transport: the test models are `openai/...` on the fake upstream, through litellm (the default
`transport: litellm`). A module marked `both_transports` also runs each test that uses `transport`
(through `config`) on memproxy's own OpenAI client (`transport: openai`).
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import aiosqlite
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from db import run_async
from fake_upstream import FakeUpstream
from memproxy.app import create_app
from memproxy.config import ApiKey, AuthConfig, Config, MemoryConfig, ModelConfig, ServerConfig, StorageConfig
from stores import StoreUnderTest, store_under_test

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROXY_KEY = "test-proxy-key-a"
OTHER_KEY = "test-proxy-key-b"


STORE_KINDS = ("sqlite", "postgres")
TRANSPORTS = ("litellm", "openai")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests of a module marked `both_stores` run on each store, of one marked `both_transports` on
    each transport; the `store_kind` and `transport` fixtures below serve the rest."""
    if "store_kind" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_stores"):
        metafunc.parametrize("store_kind", STORE_KINDS)
    if "transport" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_transports"):
        metafunc.parametrize("transport", TRANSPORTS)


# The slowest modules, slowest first. The suite runs on one worker per core with `--dist loadfile
# --no-loadscope-reorder` (pyproject.toml), which hands modules out in collection order: started
# first, the long ones no longer leave one worker running alone at the end. Measured with
# `--durations`; the rest of the modules keep their order.
SLOW_FIRST = (
    "test_bench_smoke.py",  # the quick bench, run twice: 190 s on a slow machine, the longest module
    "test_readme.py",
    "test_crash.py",
    "test_reconcile_properties.py",
    "test_clients.py",
    "test_workers.py",
    "test_cli.py",
    "test_errors.py",
    "test_hostile_input.py",
    "test_properties_memory.py",
    "test_admin_export.py",
    "test_sessions_cli.py",
    "test_signals.py",
    "test_metrics.py",
    "test_logs.py",
    "test_inspector.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's order stays


def pytest_unconfigure(config: pytest.Config) -> None:
    """A SQLite store that a failed test opened outside a fixture stays open: the failure's
    traceback holds it, so it is never collected, and its aiosqlite connection's worker thread is
    not a daemon. The interpreter would wait for that thread at exit, and the run would hang after
    reporting the failure instead of ending with it (CI would see a timeout). Such connections are
    stopped here, as aiosqlite stops one it collects."""
    main = threading.main_thread()
    if all(t is main or t.daemon for t in threading.enumerate()):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `stop` looks for an event loop, and there is none by now
        for found in gc.get_objects():
            if isinstance(found, aiosqlite.Connection):
                found.stop()


@pytest.fixture
def store_kind() -> str:
    return "sqlite"


@pytest.fixture
def transport() -> str:
    return "litellm"


@pytest.fixture
def make_storage(store_kind: str, tmp_path: Path) -> Iterator[Callable[..., StorageConfig]]:
    """A factory of empty stores of the test's kind: `make_storage("name")` is a SQLite file
    `name.db` in the test's temp dir, or a new PostgreSQL schema; each schema is dropped at the end
    (after every proxy of `start_proxy` has closed: that fixture depends on this one)."""
    made: list[StoreUnderTest] = []

    def make(name: str = "memproxy") -> StorageConfig:
        if store_kind == "sqlite":
            return StorageConfig(url=f"sqlite:///{tmp_path / f'{name}.db'}")
        made.append(run_async(lambda: store_under_test(store_kind, tmp_path)))
        return made[-1].storage

    yield make
    for under_test in made:
        run_async(under_test.drop)


@pytest.fixture
def storage(make_storage: Callable[..., StorageConfig]) -> StorageConfig:
    """The test's store: what the `config` fixture uses."""
    return make_storage()


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[FakeUpstream]:
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


@pytest.fixture
def upstream(upstream_server: FakeUpstream) -> FakeUpstream:
    upstream_server.reset()
    return upstream_server


# The core tests see the plain sliding window; tests of summaries, compaction and recall turn them on.
CORE_MEMORY: dict[str, Any] = {"summaries": False, "overflow": "drop", "tool_output_max_tokens": 0,
                               "dedupe_min_tokens": 0, "recall_tokens": 0}


def make_config(db: Path | StorageConfig, upstream_url: str, transport: str = "litellm", **memory: Any) -> Config:
    """`db`: a SQLite file, or any store (the `storage` fixture, to run on the test's store kind)."""
    return Config(
        server=ServerConfig(host="127.0.0.1", port=0),
        storage=db if isinstance(db, StorageConfig) else StorageConfig(url=f"sqlite:///{db}"),
        models=(
            ModelConfig(name="small", model="openai/small", api_base=upstream_url, api_key="upstream-secret",
                        context_window=2000, max_output_tokens=256, transport=transport),
            ModelConfig(name="big", model="openai/gpt-4o-mini", api_base=upstream_url,
                        api_key="upstream-secret", context_window=100_000, max_output_tokens=1000,
                        transport=transport),
        ),
        memory=MemoryConfig(**{"summarizer_model": "small", "safety_margin_tokens": 20, **CORE_MEMORY,
                               **memory}),
        auth=AuthConfig(keys=(ApiKey(PROXY_KEY, "a"), ApiKey(OTHER_KEY, "b"))),
    )


@pytest.fixture
def config(storage: StorageConfig, upstream: FakeUpstream, transport: str) -> Config:
    return make_config(storage, upstream.url, transport)


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
async def start_proxy(make_storage: Callable[..., StorageConfig]) -> AsyncIterator[Callable[[Config], Any]]:
    # Depending on `make_storage` closes these proxies before the test's schemas are dropped.
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


@pytest.fixture
async def http(start_proxy: Callable[[Config], Any]) -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP client for the endpoints the SDK does not cover (`/v1/sessions`, ...). It depends
    on `start_proxy` so it closes before the proxies it talks to."""
    async with aiohttp.ClientSession() as session:
        yield session


def replace_model(config: Config, **changes: Any) -> Config:
    models = tuple(replace(m, **changes) if m.name == "small" else m for m in config.models)
    return replace(config, models=models)
