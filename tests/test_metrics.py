"""`GET /metrics` (issue 16, item 1): what it counts, who may read it, one registry per app, and the
multiprocess mode with real `memproxy serve` processes sharing `PROMETHEUS_MULTIPROC_DIR`.

Scrapes are parsed with prometheus-client's own parser, so the body is checked as Prometheus reads it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import OTHER_KEY, PROXY_KEY, Proxy, make_config
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import complete
from memproxy.config import ApiKey, AuthConfig, Config, MetricsConfig, StorageConfig
from memproxy.typedefs import CONFIG, SUMMARIZER
from processes import ONE_KEY, clean_env, serve, sqlite_storage, write_config
from summaries import SUMMARIES, compact, fact_summariser
from test_failures import refuse_messages

ADMIN_KEY = "test-admin-key-1"
StartProxy = Callable[[Config], Any]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def with_admin(config: Config, **metrics: Any) -> Config:
    return replace(config, auth=replace(config.auth, admin_keys=(ADMIN_KEY,)), metrics=MetricsConfig(**metrics))


async def get_metrics(url: str, key: str | None = ADMIN_KEY) -> tuple[int, str, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers) as response:
            return response.status, response.headers["Content-Type"], await response.text()


async def scrape(proxy: Proxy, key: str | None = ADMIN_KEY) -> Samples:
    status, content_type, text = await get_metrics(str(proxy.server.make_url("/metrics")), key)
    assert status == 200, text
    assert content_type.startswith("text/plain; version=0.0.4")
    return parse(text)


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 for a series that does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` carrying `labels` (and any others)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def chat_labels(status: str, reconcile: str, model: str = "small") -> dict[str, str]:
    return {"endpoint": "/v1/chat/completions", "method": "POST", "status": status, "model": model,
            "reconcile": reconcile}


async def request(proxy: Proxy, method: str, path: str, key: str = PROXY_KEY, **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, str(proxy.server.make_url(path)),
                                headers={"Authorization": f"Bearer {key}"}, **kwargs) as response:
            return response.status, await response.text()


async def test_requests_tokens_and_latencies_are_counted(
    start_proxy: StartProxy, config: Config, upstream: FakeUpstream
) -> None:
    proxy = await start_proxy(with_admin(config))
    client = proxy.client("metric-session")
    long = "alpha " * 900  # two of these do not fit the window of 2000: the second turn leaves the first out
    history: list[dict[str, Any]] = [{"role": "user", "content": f"first {long}"}]
    answer, first = await complete(client, history)
    history += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"second {long}"}]
    answer, second = await complete(client, history)
    history += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "third"}]
    await complete(proxy.client(session=None), [{"role": "user", "content": "no memory"}])
    upstream.enqueue(Reply(status=500, error_message="provider down"))
    with pytest.raises(openai.InternalServerError):
        await complete(client, history)
    assert (await request(proxy, "GET", "/v1/sessions/metric-session"))[0] == 200
    assert (await request(proxy, "GET", "/v1/no-such-thing"))[0] == 404
    assert (await request(proxy, "GET", "/v1/chat/completions"))[0] == 405

    samples = await scrape(proxy)
    assert value(samples, "memproxy_requests_total", **chat_labels("200", "new")) == 1
    assert value(samples, "memproxy_requests_total", **chat_labels("200", "continue")) == 1
    assert value(samples, "memproxy_requests_total", **chat_labels("200", "none")) == 1
    assert value(samples, "memproxy_requests_total", **chat_labels("500", "continue")) == 1
    # Routes by pattern, never the path: no series per session or per unknown URL.
    assert value(samples, "memproxy_requests_total", endpoint="/v1/sessions/{session_id}", method="GET",
                 status="200", model="", reconcile="") == 1
    assert value(samples, "memproxy_requests_total", endpoint="unmatched", method="GET", status="404",
                 model="", reconcile="") == 1
    assert value(samples, "memproxy_requests_total", endpoint="unmatched", method="GET", status="405",
                 model="", reconcile="") == 1
    assert not any("metric-session" in v or "no-such-thing" in v for _, ls in samples for _, v in ls)
    assert not any(name == "tenant" for _, ls in samples for name, _ in ls)  # off by default

    # Tokens: what the turns sent, as the headers said, and what they saved, as the usage API says.
    sent = int(first["x-memproxy-context-tokens"]) + int(second["x-memproxy-context-tokens"])
    assert value(samples, "memproxy_tokens_sent_total", model="small") == sent
    status, body = await request(proxy, "GET", "/v1/usage")
    usage = json.loads(body)
    assert value(samples, "memproxy_tokens_saved_total", model="small") == usage["tokens_saved"] > 0
    assert value(samples, "memproxy_upstream_tokens_total", model="small", type="prompt",
                 purpose="chat") == usage["prompt_tokens"]
    assert value(samples, "memproxy_upstream_tokens_total", model="small", type="completion",
                 purpose="chat") == usage["completion_tokens"]

    # Latencies of the three answered requests: every part of the two turns' memory work, the parse
    # and the whole of the one without a session, and their upstream calls.
    for part in ("reconcile", "budget", "recall", "store", "record"):
        assert value(samples, "memproxy_memory_seconds_count", part=part) == 2, part
    assert value(samples, "memproxy_memory_seconds_count", part="parse") == 3
    assert value(samples, "memproxy_memory_seconds_count", part="memory") == 3
    assert value(samples, "memproxy_upstream_seconds_count", model="small") == 3
    assert value(samples, "memproxy_request_duration_seconds_count", endpoint="/v1/chat/completions",
                 method="POST") == 4

    # What the store holds, read at the scrape.
    assert value(samples, "memproxy_sessions_stored") == 1
    assert value(samples, "memproxy_messages_stored") == rows(config, "SELECT count(*) FROM messages")[0][0] == 4
    assert value(samples, "memproxy_build_info", version="0.1.0") == 1
    assert value(samples, "process_resident_memory_bytes") > 0


async def test_metrics_need_an_admin_key_unless_public(start_proxy: StartProxy, config: Config) -> None:
    protected = await start_proxy(with_admin(config))
    url = str(protected.server.make_url("/metrics"))
    assert (await get_metrics(url, None))[0] == 401
    assert (await get_metrics(url, "not-a-key-at-all"))[0] == 401
    status, _, body = await get_metrics(url, PROXY_KEY)  # a tenant's key: metrics span every tenant
    assert status == 403 and json.loads(body)["error"]["code"] == "forbidden"
    assert (await get_metrics(url, ADMIN_KEY))[0] == 200

    public = await start_proxy(with_admin(config, public=True))
    assert (await get_metrics(str(public.server.make_url("/metrics")), None))[0] == 200
    open_proxy = await start_proxy(replace(config, auth=AuthConfig()))  # no keys: nothing is protected
    assert (await get_metrics(str(open_proxy.server.make_url("/metrics")), None))[0] == 200
    # The refusals are counted too, under their own route.
    samples = await scrape(protected)
    assert value(samples, "memproxy_requests_total", endpoint="/metrics", method="GET", status="401",
                 model="", reconcile="") == 2
    assert value(samples, "memproxy_requests_total", endpoint="/metrics", method="GET", status="403",
                 model="", reconcile="") == 1


async def test_openmetrics_when_the_scraper_asks(start_proxy: StartProxy, config: Config) -> None:
    proxy = await start_proxy(with_admin(config))
    async with aiohttp.ClientSession() as http:
        async with http.get(str(proxy.server.make_url("/metrics")), headers={
                "Authorization": f"Bearer {ADMIN_KEY}", "Accept": "application/openmetrics-text; version=1.0.0"}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert (await r.text()).endswith("# EOF\n")


@pytest.mark.parametrize("accept", [b"application/openmetrics-text; version=x", b"text/plain; version=1.0.0x",
                                    b"application/openmetrics-text; version=2.x<b>",
                                    b"application/openmetrics-text; version=2.\xff"],
                         ids=["not-numbers", "text-not-numbers", "echoed", "not-utf-8"])
async def test_an_accept_naming_a_version_that_is_not_numbers_gets_the_text_format(
    start_proxy: StartProxy, config: Config, accept: bytes
) -> None:
    """prometheus-client compares the version a scraper asks for as numbers: one that is not was a
    500, or, where its first number decided, was echoed as sent into the answer's Content-Type."""
    proxy = await start_proxy(with_admin(config))
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer "
                 + ADMIN_KEY.encode() + b"\r\nAccept: " + accept + b"\r\n\r\n")
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b"\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n" in head, head
    assert b"memproxy_build_info" in body


async def test_tenant_label_when_configured(start_proxy: StartProxy, config: Config) -> None:
    config = replace(with_admin(config, tenant_label=True),
                     auth=AuthConfig(keys=(ApiKey(PROXY_KEY, "a"), ApiKey(OTHER_KEY, "b")), admin_keys=(ADMIN_KEY,)))
    proxy = await start_proxy(config)
    await complete(proxy.client("s1"), [{"role": "user", "content": "hi"}])
    await complete(proxy.client("s1", key=OTHER_KEY), [{"role": "user", "content": "hi"}])
    await complete(proxy.client("s2", key=OTHER_KEY), [{"role": "user", "content": "hi"}])
    samples = await scrape(proxy)
    assert value(samples, "memproxy_requests_total", **chat_labels("200", "new"), tenant="a") == 1
    assert value(samples, "memproxy_requests_total", **chat_labels("200", "new"), tenant="b") == 2
    assert total(samples, "memproxy_tokens_sent_total", tenant="b") > total(samples, "memproxy_tokens_sent_total",
                                                                            tenant="a") > 0
    # The scrape counted before it: the admin key's own request, labelled as such.
    again = await scrape(proxy)
    assert value(again, "memproxy_requests_total", endpoint="/metrics", method="GET", status="200", model="",
                 reconcile="", tenant="(admin)") == 1


async def test_each_app_has_its_own_registry(start_proxy: StartProxy, config: Config) -> None:
    first = await start_proxy(with_admin(config))
    second = await start_proxy(with_admin(config))
    await complete(first.client("s1"), [{"role": "user", "content": "hi"}])
    assert value(await scrape(first), "memproxy_requests_total", **chat_labels("200", "new")) == 1
    assert total(await scrape(second), "memproxy_requests_total", endpoint="/v1/chat/completions") == 0


async def test_summaries_by_outcome_and_tokens_summarised(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    config = with_admin(make_config(storage, upstream.url, **SUMMARIES, chunk_threshold_tokens=1_000_000))
    proxy = await start_proxy(config)
    upstream.summarizer = fact_summariser
    client = proxy.client("s1")
    history: list[dict[str, Any]] = []
    for turn in range(6):
        history.append({"role": "user", "content": f"question {turn}: FACT-{turn} " + "words " * 40})
        completion, _ = await complete(client, history)
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
    status, body = await compact(proxy, "s1", body={"model": "small"})
    assert status == 200 and body["outcome"] == "applied", body
    status, body = await compact(proxy, "s1", body={"model": "small"})
    assert status == 200 and body["outcome"] == "nothing", body
    await proxy.app[SUMMARIZER].wait_idle()
    samples = await scrape(proxy)
    assert value(samples, "memproxy_summaries_total", outcome="applied") == 1
    assert value(samples, "memproxy_summaries_total", outcome="nothing") == 1
    folded = rows(proxy.app[CONFIG], "SELECT replaced_tokens, tokens FROM summaries")
    assert value(samples, "memproxy_tokens_summarised_total", model="small") == folded[0][0] > 0
    assert value(samples, "memproxy_upstream_tokens_total", model="small", type="prompt", purpose="summary") > 0


async def test_store_errors_are_counted(start_proxy: StartProxy, config: Config, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(with_admin(config))
    refuse_messages(config)
    _, headers = await complete(proxy.client("s1"), [{"role": "user", "content": "hi"}])
    assert headers["x-memproxy-stored"] == "false"  # answered, not remembered
    samples = await scrape(proxy)
    assert value(samples, "memproxy_store_errors_total", where="record") == 1


# --- several processes: PROMETHEUS_MULTIPROC_DIR --------------------------------------------------


def test_two_processes_sharing_the_multiprocess_directory_are_scraped_as_one(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    auth = ONE_KEY + f'  admin_keys: ["{ADMIN_KEY}"]\n'
    config = write_config(tmp_path / "memproxy.yaml", upstream.url, sqlite_storage(tmp_path / "shared.db"),
                          auth=auth)
    env = clean_env(PROMETHEUS_MULTIPROC_DIR=str(folder))
    workers = serve(config, [tmp_path / "a.log", tmp_path / "b.log"], env=env)
    try:
        for i, worker in enumerate(workers):
            worker.client(f"s{i}").chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
        texts = []
        for worker in workers:
            with httpx.Client(timeout=30) as http:
                response = http.get(f"{worker.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert response.status_code == 200, response.text
                texts.append(response.text)
    finally:
        codes = [worker.stop() for worker in workers]
    assert codes == [0, 0], [w.log.read_text() for w in workers]
    files = {tuple(p.stem.split("_")) for p in folder.iterdir()}  # the library's: kind_pid.db
    assert files == {(kind, str(w.process.pid)) for kind in ("counter", "histogram") for w in workers}
    for text in texts:  # either process answers for both
        samples = parse(text)
        assert value(samples, "memproxy_requests_total", **chat_labels("200", "new")) == 2
        assert value(samples, "memproxy_upstream_seconds_count", model="small") == 2
        assert value(samples, "memproxy_sessions_stored") == 2
        assert not any(name.startswith("process_") for name, _ in samples)  # one process's: left out
