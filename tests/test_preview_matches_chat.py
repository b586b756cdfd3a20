"""The context preview and a real chat turn agree: one budget rule (memory.plan), one fit.

`POST /v1/sessions/{id}/context` promises exactly what the next request would send. Each case below
previews a turn with some output-reserve parameters, then sends that turn through the `openai` SDK:
both must come out the same (the same budget, the same messages upstream, or the same 400).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest

from conftest import PROXY_KEY, Proxy, make_config
from fake_upstream import FakeUpstream
from memproxy.config import StorageConfig

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]
WINDOW, MARGIN, DEFAULT_RESERVE = 2000, 20, 256  # the conftest model "small"

CASES: dict[str, tuple[dict[str, Any], int | None]] = {  # parameters -> the reserve, None: a 400
    "default": ({}, DEFAULT_RESERVE),
    "max_tokens": ({"max_tokens": 900}, 900),
    "both, the larger reserved": ({"max_completion_tokens": 300, "max_tokens": 900}, 900),
    "zero is refused": ({"max_tokens": 0}, None),  # once read by the preview as "no reserve given"
    "not an integer": ({"max_tokens": "lots"}, None),
    "the whole window": ({"max_tokens": WINDOW}, None),
    "no room for input": ({"max_tokens": WINDOW - 10}, None),
}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


@pytest.fixture
async def http(start_proxy: Callable[..., Any]) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:  # closes before the proxies it talks to
        yield session


@pytest.mark.parametrize("case", list(CASES))
async def test_preview_and_chat_agree_on_reserve_budget_and_messages(
    start_proxy: Callable[..., Any], make_storage: Callable[..., StorageConfig], upstream: FakeUpstream,
    http: aiohttp.ClientSession, case: str,
) -> None:
    params, reserve = CASES[case]
    proxy: Proxy = await start_proxy(make_config(make_storage("memproxy"), upstream.url, overflow="marker"))
    client = proxy.client(session="s1")
    for i in range(8):  # about 1,300 tokens stored: a big reserve leaves some of it out
        await client.chat.completions.create(model="small", messages=[user(f"turn {i}: " + "word " * 150)])

    async with http.post(f"{proxy.url}/sessions/s1/context", headers={"Authorization": f"Bearer {PROXY_KEY}"},
                         json={"model": "small", "messages": [user("what next?")], **params}) as response:
        preview_status, preview = response.status, await response.json()

    sent: Any = [user("what next?")]
    extra: Any = params
    try:
        raw = await client.chat.completions.with_raw_response.create(model="small", messages=sent, **extra)
    except openai.APIStatusError as exc:
        assert reserve is None, f"{case}: the chat refused a valid reserve: {exc.body}"
        assert preview_status == exc.status_code == 400
        assert preview == exc.response.json()  # the same error, type, code and param
        return
    raw.parse()
    assert reserve is not None and preview_status == 200, f"{case}: the preview refused it: {preview}"
    assert preview["budget"] == {"window": WINDOW, "output_reserve": reserve, "safety_margin": MARGIN,
                                 "input_tokens": WINDOW - reserve - MARGIN, "calibration": 1.0,
                                 "planned_tokens": WINDOW - reserve - MARGIN}
    assert int(raw.headers["X-Memproxy-Input-Budget"]) == preview["budget"]["input_tokens"]
    assert int(raw.headers["X-Memproxy-Context-Tokens"]) == preview["tokens"]
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    omitted = int(raw.headers["X-Memproxy-Stored-Omitted"])
    assert omitted == next(p for p in preview["parts"] if p["part"] == "left_out")["messages"]
    if reserve == 900:
        assert omitted > 0  # the case proves the reserve shapes what is sent
