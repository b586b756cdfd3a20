"""litellm's synchronous set-up of a call runs on the event loop for the providers whose set-up does
no I/O, and on a thread for every other (`memproxy.inline_setup`).

Where it ran is read from litellm's own pre-call hook (`log_pre_api_call` of a CustomLogger,
`tests/callback_recorder.py`), which litellm calls from inside that set-up.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest

from callback_recorder import RecordingLogger
from conftest import Proxy, make_config
from fake_anthropic import FakeAnthropic, Reply as ClaudeReply
from fake_upstream import FakeUpstream, Reply
from helpers import chat, user
from memproxy import inline_setup
from memproxy.config import Config, LitellmConfig, ModelConfig, StorageConfig
from memproxy.provider import Provider, _fetches
from test_anthropic import claude_config
from test_observability import StartProxy

RECORDER = "callback_recorder:RECORDER"


@pytest.fixture(autouse=True)
def recorder() -> Iterator[type[RecordingLogger]]:
    RecordingLogger.clear()
    yield RecordingLogger
    RecordingLogger.clear()


@pytest.fixture
def anthropic() -> Iterator[FakeAnthropic]:
    fake = FakeAnthropic().start()
    yield fake
    fake.stop()


def recorded(config: Config) -> Config:
    return replace(config, litellm=LitellmConfig(callbacks=(RECORDER,)))


async def test_only_the_first_hand_off_asked_for_runs_in_place() -> None:
    loop = asyncio.get_running_loop()
    here = threading.current_thread().name

    async def where() -> str:
        return await loop.run_in_executor(None, lambda: threading.current_thread().name)

    assert await where() != here  # a plain loop's executor: a thread
    with inline_setup.inline():
        assert await where() != here  # the loop's own executor ignores the request
    inline_setup.install(loop)
    with inline_setup.inline():
        assert await where() == here
        assert await where() != here  # the call's later hand-offs (a DNS lookup) keep their thread
    assert await where() != here
    with inline_setup.inline(False):
        assert await where() != here

    def fails() -> None:
        raise LookupError("from the set-up")

    with pytest.raises(LookupError, match="from the set-up"), inline_setup.inline():
        await loop.run_in_executor(None, fails)


async def test_an_openai_compatible_call_is_set_up_on_the_loop(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger]
) -> None:
    proxy: Proxy = await start_proxy(recorded(make_config(storage, upstream.url)))
    upstream.enqueue(Reply(content="One."), Reply(content="Two."))
    client = proxy.client("s1")
    assert (await chat(client, [user("Count: one?")]))[0] == "One."
    stream = await client.chat.completions.create(model="small", messages=[user("And two?")], stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "Two."
    assert recorder.set_up_on == [threading.current_thread().name] * 2


async def test_another_endpoints_call_is_set_up_on_the_loop(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, recorder: type[RecordingLogger]
) -> None:
    proxy: Proxy = await start_proxy(recorded(make_config(storage, upstream.url)))
    result = await proxy.client(session=None).embeddings.create(model="small", input="hello")
    assert len(result.data) == 1
    assert recorder.set_up_on == [threading.current_thread().name]


async def test_a_call_whose_set_up_may_fetch_keeps_its_thread(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic, recorder: type[RecordingLogger]
) -> None:
    """litellm downloads an image URL while it builds an Anthropic request: not on the loop."""
    proxy: Proxy = await start_proxy(recorded(claude_config(storage, anthropic)))
    anthropic.enqueue(ClaudeReply(text="Hello."))
    answer = await proxy.client("s1").chat.completions.create(model="claude", messages=[user("Hi.")])
    assert answer.choices[0].message.content == "Hello."
    [thread] = recorder.set_up_on
    assert thread != threading.current_thread().name and thread.startswith("memproxy-executor")


def test_the_providers_set_up_in_place_are_named_by_litellms_provider() -> None:
    provider = Provider(Config(models=(
        ModelConfig(name="a", model="gpt-4o-mini", api_key="k"),  # litellm's `openai`
        ModelConfig(name="b", model="claude-haiku-4-5", api_key="k"),  # litellm's `anthropic`
        ModelConfig(name="c", model="hosted_vllm/llama", api_base="http://127.0.0.1:1/v1", context_window=8000),
    )))
    assert {name: provider._inline[name] for name in "abc"} == {"a": True, "b": False, "c": True}


@pytest.mark.parametrize(("file_id", "fetched"), [("https://example.com/a.pdf", True), ("http://10.0.0.1/a", True),
                                                  ("www.example.com/a.pdf", True), ("file-abc123", False)])
def test_a_call_litellm_downloads_a_file_for_keeps_its_thread(file_id: str, fetched: bool) -> None:
    part = {"type": "file", "file": {"file_id": file_id}}
    assert _fetches([user("Hi."), {"role": "user", "content": [{"type": "text", "text": "Read it."}, part]}]) \
        is fetched
    assert not _fetches([{"role": "assistant", "content": [part]}])  # litellm reads users' parts alone
