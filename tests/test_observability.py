"""litellm's callbacks from the config file (issue 15, item 8): off by default, named in `litellm.callbacks`,
called for the proxy's requests through litellm, announced by a WARNING at start that says they receive
message content, and gone from litellm when the proxy stops.

The callback is `tests/callback_recorder.py`, a litellm CustomLogger named by its Python path, so litellm
needs no network; the provider is the fake OpenAI upstream reached through litellm (`transport: litellm`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from callback_recorder import RECORDER, RecordingLogger
from conftest import PROXY_KEY, Proxy, make_config
from fake_upstream import FakeUpstream, Reply
from helpers import chat, until, user
from memproxy.config import Config, ConfigError, LitellmConfig, StorageConfig
from memproxy.provider import Provider, load_litellm
from processes import clean_env, serve_one, sqlite_storage, write_config
from test_cli import run_cli

StartProxy = Callable[[Config], Any]
TESTS = str(Path(__file__).resolve().parent)
LISTS = ("callbacks", "input_callback", "success_callback", "failure_callback", "_async_success_callback",
         "_async_failure_callback")


@pytest.fixture(autouse=True)
def recorder() -> Iterator[type[RecordingLogger]]:
    RecordingLogger.clear()
    yield RecordingLogger
    RecordingLogger.clear()


def observed(storage: StorageConfig, upstream: FakeUpstream, *callbacks: str, transport: str = "litellm",
             **settings: Any) -> Config:
    config = make_config(storage, upstream.url, transport)
    return replace(config, litellm=LitellmConfig(callbacks=callbacks, **settings))


def registered() -> list[Any]:
    """Everything in litellm's callback lists."""
    litellm = load_litellm()
    return [item for name in LISTS for item in getattr(litellm, name)]


@pytest.mark.parametrize("path", ["callback_recorder.RecordingLogger", "callback_recorder:RECORDER"])
async def test_a_configured_callback_sees_each_chat_request(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger],
    caplog: pytest.LogCaptureFixture, path: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="memproxy")
    proxy: Proxy = await start_proxy(observed(storage, upstream, path))
    warnings = [r for r in caplog.records if r.name == "memproxy.observability" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert path in warnings[0].getMessage() and "content of every message" in warnings[0].getMessage()

    upstream.enqueue(Reply(content="Noted, the code is 4471."))
    answer, _ = await chat(proxy.client("s1"), [user("Remember the code 4471.")])
    assert answer == "Noted, the code is 4471."
    await until(lambda: bool(recorder.seen()), "the callback saw the request")
    [event] = recorder.seen()
    assert event.kind == "success"
    assert event.kwargs["model"] == "small"  # litellm's name of `openai/small`
    assert event.kwargs["messages"][-1] == user("Remember the code 4471.")
    payload = event.kwargs["standard_logging_object"]  # what litellm's integrations send
    assert payload["response"]["choices"][0]["message"]["content"] == "Noted, the code is 4471."
    assert "upstream-secret" not in str(payload)  # the provider key is in no integration's payload
    # memproxy's own logs hold neither message content nor keys.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "4471" not in logged and "upstream-secret" not in logged and PROXY_KEY not in logged


async def test_a_failed_call_is_reported_to_the_callback(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger],
) -> None:
    proxy: Proxy = await start_proxy(observed(storage, upstream, "callback_recorder.RecordingLogger"))
    upstream.enqueue(Reply(status=500, error_message="model overloaded"))
    with pytest.raises(openai.APIStatusError):
        await chat(proxy.client("s1"), [user("Hello?")])
    await until(lambda: any(e.kind == "failure" for e in recorder.seen()), "the callback saw the failure")


async def test_turn_off_message_logging_keeps_content_out_of_the_integrations_payload(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="memproxy")
    proxy: Proxy = await start_proxy(observed(storage, upstream, "callback_recorder.RecordingLogger",
                                              turn_off_message_logging=True))
    assert any("turn_off_message_logging" in r.getMessage() for r in caplog.records)
    upstream.enqueue(Reply(content="The secret is safe."))
    await chat(proxy.client("s1"), [user("My secret is 8812.")])
    await until(lambda: bool(recorder.seen()), "the callback saw the request")
    payload = str(recorder.seen()[0].kwargs["standard_logging_object"])
    assert "8812" not in payload and "The secret is safe." not in payload


async def test_models_on_memproxys_own_client_are_named_as_unseen(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`openai/` models use memproxy's own client unless `transport: litellm`: the start-up warning
    names them, and their calls never reach the callback."""
    caplog.set_level(logging.WARNING, logger="memproxy")
    config = observed(storage, upstream, "callback_recorder.RecordingLogger", transport="openai")
    config = replace(config, models=(replace(config.models[0], transport="litellm"), config.models[1]))
    proxy: Proxy = await start_proxy(config)
    assert any("do not see models big" in r.getMessage() for r in caplog.records)
    await chat(proxy.client("s1"), [user("To the big model.")], model="big")
    await chat(proxy.client("s2"), [user("To the small model.")], model="small")
    await until(lambda: bool(recorder.seen()), "the callback saw the small model's request")
    assert [e.kwargs["messages"][-1]["content"] for e in recorder.seen()] == ["To the small model."]


async def test_off_by_default_and_gone_when_the_proxy_stops(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="memproxy")
    before = registered()
    plain = Provider(make_config(storage, upstream.url, "litellm"))
    assert registered() == before
    await plain.close()
    assert not [r for r in caplog.records if r.name == "memproxy.observability"]

    observing = Provider(observed(storage, upstream, "callback_recorder:RECORDER"))
    assert RECORDER in load_litellm().callbacks
    await observing.close()
    assert registered() == before and RECORDER not in registered()


@pytest.mark.parametrize(("name", "why"), [
    ("langfuze", "litellm has no callback 'langfuze'"),
    ("no_such_module_here.Logger", "cannot import 'no_such_module_here'"),
    ("json.dumps", "'json.dumps' is not a litellm CustomLogger"),
    ("callback_recorder.Missing", "is not a litellm CustomLogger"),
])
def test_a_callback_that_cannot_be_found_fails_at_start(
    storage: StorageConfig, upstream: FakeUpstream, name: str, why: str
) -> None:
    before = registered()
    with pytest.raises(ConfigError) as caught:
        Provider(observed(storage, upstream, "langfuse", name))
    assert caught.value.key == "litellm.callbacks[1]"
    assert why in caught.value.why
    assert registered() == before


def test_serve_warns_at_start_and_check_config_names_a_bad_callback(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    """As a user runs it: `memproxy serve` logs the warning (and no key); `check-config` refuses a
    callback litellm does not know, naming the key."""
    env = clean_env(PYTHONPATH=TESTS)
    config = write_config(tmp_path / "memproxy.yaml", upstream.url, sqlite_storage(tmp_path / "m.db"),
                          extra="litellm:\n  callbacks: [callback_recorder.RecordingLogger]\n")
    config.write_text(config.read_text().replace("model: openai/small", "model: openai/small\n    transport: litellm"))
    served = serve_one(config, tmp_path / "stderr.log", env=env)
    try:
        upstream.enqueue(Reply(content="Hi."))
        served.client().chat.completions.create(model="small", messages=[{"role": "user", "content": "Hello 5309"}])
    finally:
        assert served.stop() == 0
    log = served.log.read_text()
    assert "WARNING memproxy.observability litellm callbacks on (callback_recorder.RecordingLogger)" in log
    assert "content of every message" in log
    assert "upstream-secret" not in log and "5309" not in log

    config.write_text(config.read_text().replace("callback_recorder.RecordingLogger", "langfuze"))
    result = run_cli("check-config", "-c", str(config), PYTHONPATH=TESTS)
    assert result.returncode == 2
    assert "litellm.callbacks[0]: litellm has no callback 'langfuze'" in result.stderr
