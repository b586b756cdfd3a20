from fake_upstream import FakeUpstream
from conftest import Proxy


async def test_remembers(proxy: Proxy, upstream: FakeUpstream) -> None:
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
