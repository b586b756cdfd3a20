import json

import pytest

from conftest import Proxy
from db import rows
from fake_upstream import FakeUpstream
from memproxy.config import Config

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]


async def test_remembers(proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    client = proxy.client()
    r1 = await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
    assert r1.choices[0].message.content == "reply 1"
    r2 = await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "again"}])
    assert upstream.last().messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "again"},
    ]
    stream = await client.chat.completions.create(model="small", stream=True,
                                                  messages=[{"role": "user", "content": "third"}])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "reply 3"
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "4"}])
    assert len(upstream.last().messages) == 7
    stored = [json.loads(body)["content"] for (body,) in rows(config, "SELECT body FROM messages ORDER BY seq")]
    assert stored == ["hi", "reply 1", "again", r2.choices[0].message.content, "third", "reply 3", "4", "reply 4"]
