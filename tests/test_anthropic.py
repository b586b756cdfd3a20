"""A non-OpenAI provider end to end (issue 15, item 7): Anthropic's Messages API through litellm.

The proxy runs as a real server with a model `anthropic/claude-haiku-4-5` whose `api_base` is
`tests/fake_anthropic.py`, a real server speaking Anthropic's own wire format; the client is the
official `openai` SDK with `X-Session-Id`, sending only each turn's new messages. Each test checks
both sides: what the client got back in OpenAI's shape, and what the provider received in Anthropic's
(system prompt top-level, text / tool_use / tool_result blocks, the stored history translated). The
fake refuses what the real API refuses, so every request that went through was a valid one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import openai
import pytest

import db
from conftest import CORE_MEMORY, PROXY_KEY, Proxy
from fake_anthropic import FakeAnthropic, Received, Reply, ToolUse, refused
from memproxy.config import ApiKey, AuthConfig, Config, MemoryConfig, ModelConfig, ServerConfig, StorageConfig
from memproxy.typedefs import SUMMARIZER
from summaries import FACT, fact_summary, stored, summary_rows
from test_budget import words

pytestmark = pytest.mark.both_stores

MODEL = "anthropic/claude-haiku-4-5"
UPSTREAM_KEY = "anthropic-dummy-key"
SYSTEM = "You are a terse assistant."
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
StartProxy = Callable[[Config], Any]
Message = dict[str, Any]


@pytest.fixture(scope="module")
def anthropic_server() -> Iterator[FakeAnthropic]:
    fake = FakeAnthropic().start()
    yield fake
    fake.stop()


@pytest.fixture
def anthropic(anthropic_server: FakeAnthropic) -> FakeAnthropic:
    anthropic_server.reset()
    return anthropic_server


def claude_config(storage: StorageConfig, fake: FakeAnthropic, context_window: int | None = None,
                  **memory: Any) -> Config:
    """One model, Claude at the fake; its window litellm's unless given."""
    return Config(
        server=ServerConfig(host="127.0.0.1", port=0),
        storage=storage,
        models=(ModelConfig(name="claude", model=MODEL, api_base=fake.url, api_key=UPSTREAM_KEY,
                            context_window=context_window, max_output_tokens=256),),
        memory=MemoryConfig(**{**CORE_MEMORY, **memory}),
        auth=AuthConfig(keys=(ApiKey(PROXY_KEY, "a"),)),
    )


def text(value: str) -> list[Message]:
    return [{"type": "text", "text": value}]


def user(value: str) -> Message:
    return {"role": "user", "content": value}


async def ask(client: openai.AsyncOpenAI, *messages: Message, **params: Any) -> Any:
    sent: Any = [{"role": "system", "content": SYSTEM}, *messages]
    return await client.chat.completions.create(model="claude", messages=sent, **params)


# --- a conversation with memory ----------------------------------------------------------------


async def test_conversation_with_memory_reaches_anthropic_in_its_own_format(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("s1")
    anthropic.enqueue(Reply(text="Noted: Ada."), Reply(text="Ada, born 1815."), Reply(text="London."))
    answers = []
    for question in ("My name is Ada.", "When was I born?", "And where?"):
        completion = await ask(client, user(question))
        answers.append(completion.choices[0].message.content)
        assert completion.choices[0].finish_reason == "stop"
    assert answers == ["Noted: Ada.", "Ada, born 1815.", "London."]
    received = anthropic.chat_requests()
    assert len(received) == 3
    last = received[-1]
    assert last.path == "/v1/messages"
    assert last.headers["x-api-key"] == UPSTREAM_KEY  # the provider's key, never the client's proxy key
    assert PROXY_KEY not in json.dumps(last.headers)
    assert last.headers["anthropic-version"]
    assert last.body["model"] == "claude-haiku-4-5"
    assert last.body["system"] == text(SYSTEM)  # top-level, not among the messages
    # The client sent only the new question; the proxy added the stored turns, litellm translated.
    assert last.messages == [
        {"role": "user", "content": text("My name is Ada.")},
        {"role": "assistant", "content": text("Noted: Ada.")},
        {"role": "user", "content": text("When was I born?")},
        {"role": "assistant", "content": text("Ada, born 1815.")},
        {"role": "user", "content": text("And where?")},
    ]
    # What the proxy stored is OpenAI's shape, whatever the provider speaks (the system prompt is the
    # client's to send each time: it is not stored).
    assert stored(config) == [
        user("My name is Ada."), {"role": "assistant", "content": "Noted: Ada."},
        user("When was I born?"), {"role": "assistant", "content": "Ada, born 1815."},
        user("And where?"), {"role": "assistant", "content": "London."},
    ]


async def test_a_models_own_headers_reach_anthropic(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    config = claude_config(storage, anthropic)
    config = replace(config, models=(replace(config.models[0], headers={"anthropic-beta": "context-1m-2025-08-07",
                                                                        "X-Gateway-Key": "gw-secret-1"}),))
    proxy: Proxy = await start_proxy(config)
    anthropic.enqueue(Reply(text="Hello."))
    await ask(proxy.client("s1"), user("Hi."))
    [received] = anthropic.chat_requests()
    headers = {k.lower(): v for k, v in received.headers.items()}
    assert (headers["anthropic-beta"], headers["x-gateway-key"]) == ("context-1m-2025-08-07", "gw-secret-1")
    assert headers["x-api-key"] == UPSTREAM_KEY


async def test_usage_is_anthropics_translated(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    proxy: Proxy = await start_proxy(claude_config(storage, anthropic))
    anthropic.enqueue(Reply(text="Hi.", input_tokens=321, output_tokens=4))
    completion = await ask(proxy.client("s1"), user("Hello"))
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (321, 4)


async def test_without_max_tokens_claude_is_asked_for_the_reserved_output(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """litellm alone would ask Claude for its whole output (64,000 tokens), which with a long input
    exceeds the window and is refused; memproxy asks for the output its budget reserved, and a
    client's own max_tokens goes as sent."""
    proxy: Proxy = await start_proxy(claude_config(storage, anthropic))
    client = proxy.client("s1")
    await ask(client, user("Hello"))
    await ask(client, user("Hello again"), max_tokens=100)
    await ask(client, user("And again"), max_completion_tokens=120)
    assert [r.body["max_tokens"] for r in anthropic.chat_requests()] == [256, 100, 120]


async def test_openai_parameters_reach_claude_translated_and_only_so(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """What litellm translates for Claude (or handles itself) goes in Claude's form alone: forced
    through as well, each went beside it as it came, and Anthropic refuses a field it does not know.
    So a client's `user`, `max_completion_tokens` or `stop` was a 400, and so was every streamed turn
    of a session, for the `stream_options` memproxy asks the usage it records by."""
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("s1")
    await ask(client, user("Hello"), user="u-1", max_completion_tokens=50, parallel_tool_calls=False, tools=TOOLS,
              stop=["END"])
    sent = anthropic.chat_requests()[-1].body
    assert (sent["metadata"], sent["max_tokens"], sent["tool_choice"], sent["stop_sequences"]) == (
        {"user_id": "u-1"}, 50, {"type": "auto", "disable_parallel_tool_use": True}, ["END"])
    anthropic.enqueue(Reply(text="Streamed.", input_tokens=40, output_tokens=3))
    stream = await ask(client, user("Stream it"), stream=True)
    assert [c.usage for c in [chunk async for chunk in stream] if c.usage is not None] == []  # not asked for
    assert "stream_options" not in anthropic.chat_requests()[-1].body
    turns = db.rows(config, "SELECT prompt_tokens, completion_tokens FROM turns ORDER BY id")
    assert tuple(turns[-1]) == (40, 3)  # yet recorded with its usage


# --- tools ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["new", "full"])
async def test_tool_use_round_trip(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic, style: str
) -> None:
    """Claude's tool_use comes back as OpenAI tool_calls; the client's tool result goes to Claude as a
    tool_result block right after its tool_use, whether the client resends the history or not."""
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("s1")
    anthropic.enqueue(Reply(text="Let me look.", tool_uses=[ToolUse("weather", {"city": "Paris"}, "toolu_01")]),
                      Reply(text="Sunny in Paris."), Reply(text="You asked about Paris."))
    question = user("Weather in Paris?")
    first = await ask(client, question, tools=TOOLS)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_01", "weather",
                                                                                  {"city": "Paris"})
    assert anthropic.chat_requests()[0].body["tools"][0]["name"] == "weather"
    assert anthropic.chat_requests()[0].body["tools"][0]["input_schema"] == TOOLS[0]["function"]["parameters"]

    echoed: Message = {"role": "assistant", "content": message.content,
                       "tool_calls": [call.model_dump(exclude_none=True)]}
    result: Message = {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C, sunny"}
    earlier = [question, echoed] if style == "full" else []
    second = await ask(client, *earlier, result, tools=TOOLS)
    assert second.choices[0].message.content == "Sunny in Paris."
    tool_turn = [
        {"role": "user", "content": text("Weather in Paris?")},
        {"role": "assistant", "content": [*text("Let me look."), {"type": "tool_use", "id": "toolu_01",
                                                                 "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"}]},
    ]
    assert anthropic.chat_requests()[1].messages == tool_turn

    # A later turn carries the whole tool exchange from the store.
    follow_up = [*earlier, result, {"role": "assistant", "content": "Sunny in Paris."}] if style == "full" else []
    third = await ask(client, *follow_up, user("Which city was that?"), tools=TOOLS)
    assert third.choices[0].message.content == "You asked about Paris."
    assert anthropic.chat_requests()[2].messages == [
        *tool_turn, {"role": "assistant", "content": text("Sunny in Paris.")},
        {"role": "user", "content": text("Which city was that?")}]
    assert [m["role"] for m in stored(config)] == ["user", "assistant", "tool", "assistant", "user", "assistant"]


async def test_a_request_anthropic_refuses_is_an_openai_shaped_error(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """A client that answers no tool call: Claude refuses with 400, and the client gets it as OpenAI's
    400 with Anthropic's words; nothing of the refused turn is stored."""
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    dangling: Message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_09", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(proxy.client("s1"), user("Weather in Oslo?"), dangling, user("Never mind."), tools=TOOLS)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and set(error) >= {"message", "type", "code", "param"}
    # Anthropic's own words, out of its error body, without litellm's class names.
    assert error["message"].startswith("messages.1: `tool_use` ids were found without `tool_result` blocks")
    assert len(anthropic.requests()) == 1
    assert stored(config) == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_request_litellm_cannot_translate_is_refused_without_quoting_the_history(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic, stream: bool
) -> None:
    """litellm reads a tool call's arguments as JSON to make Anthropic's `tool_use` block; arguments
    it cannot read (nested past Python's stack) it refuses with a 400 whose text quoted every
    message it was to send: the session's stored turns too, answered to the client. The reason
    stays, the messages do not; nothing is sent or stored."""
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("s1")
    anthropic.enqueue(Reply(text="Noted."))
    await ask(client, user("My locker code is okapi-4471."))
    deep: Message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_01", "type": "function", "function": {"name": "weather", "arguments": "[" * 5000 + "]" * 5000}}]}
    result: Message = {"role": "tool", "tool_call_id": "toolu_01", "content": "sunny"}
    with pytest.raises(openai.BadRequestError) as caught:
        answer = await ask(client, deep, result, tools=TOOLS, stream=stream)
        async for _ in answer:
            pass
    error = caught.value.body
    assert isinstance(error, dict) and error["message"].startswith("maximum recursion depth exceeded"), error
    assert "okapi-4471" not in json.dumps(error) and "Received" not in error["message"], error
    assert len(anthropic.requests()) == 1
    assert stored(config) == [user("My locker code is okapi-4471."), {"role": "assistant", "content": "Noted."}]


async def test_claude_refusing_a_prompt_as_too_long_gets_it_planned_again_for_its_count(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """Claude counts a request higher than memproxy's estimate and refuses it as Anthropic does
    ("prompt is too long"); litellm says so for any provider, and the turn is planned again for the
    count Claude gave and sent once more: the client gets the answer (`memory.calibrate_tokens`)."""
    config = claude_config(storage, anthropic, context_window=2000)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("long")
    for i in range(6):
        anthropic.enqueue(Reply(text=f"answer {i} " * 80))
        await ask(client, user(f"question {i}?"))
    anthropic.enqueue(Reply(status=400, error_type="invalid_request_error",
                            error_message="prompt is too long: 2600 tokens > 2000 maximum"),
                      Reply(text="short enough"))
    raw = await client.chat.completions.with_raw_response.create(
        model="claude", messages=[{"role": "system", "content": SYSTEM}, user("and now?")])
    assert raw.parse().choices[0].message.content == "short enough"
    assert float(raw.headers["X-Memproxy-Token-Calibration"]) > 1.2
    refused, answered = anthropic.chat_requests()[-2:]
    assert len(answered.messages) < len(refused.messages)  # less history, the new message still last
    assert answered.messages[-1] == {"role": "user", "content": text("and now?")}
    turns = stored(config, "long")
    assert len(turns) == 2 * 6 + 2
    assert turns[-2:] == [user("and now?"), {"role": "assistant", "content": "short enough"}]


@pytest.mark.parametrize("overflow", ["drop", "marker"])
async def test_a_conversation_past_claudes_window_always_opens_with_the_user(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic, overflow: str
) -> None:
    """Turns of every length past a 2,000-token window: wherever older history is cut, what Claude
    gets opens with a user message (summary and marker go to the top-level system prompt), as the
    Messages API requires; the fake refuses anything else."""
    config = claude_config(storage, anthropic, context_window=2000, overflow=overflow, calibrate_tokens=False)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("past")
    for i in range(12):
        anthropic.enqueue(Reply(text=f"answer {i} " * (40 + 7 * i)))
        await ask(client, user(f"question {i} " * (30 + 11 * i)))  # raises on a refusal
    sent = anthropic.chat_requests()
    assert len(sent) == 12
    assert len(sent[-1].messages) < 2 * 12 - 1  # older history was left out
    assert all(r.messages[0]["role"] == "user" for r in sent)


async def test_a_tool_loop_past_claudes_window_opens_with_the_user(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """Where the new messages are tool results, the newest exchange opens at the stored question
    that made the calls, and the message before it is the last exchange's answer: kept alone, it
    opened what Claude got (the fake, as the Messages API, refuses that)."""
    config = claude_config(storage, anthropic, context_window=2000, overflow="marker", calibrate_tokens=False)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("tools-past")
    for i in range(6):
        anthropic.enqueue(Reply(text=f"answer {i} " * 60))
        await ask(client, user(f"question {i} " * 60))
    # Large results and short answers: the room before the newest exchange holds the last answer
    # and not the call and results before it.
    for k in range(8):
        anthropic.enqueue(Reply(text="Checking.", tool_uses=[ToolUse("weather", {"city": "Paris"}, f"toolu_{k}")]),
                          Reply(text=f"Mild, {k}."))
        asked = await ask(client, user(f"weather {k}?"), tools=TOOLS)
        [called] = asked.choices[0].message.tool_calls
        await ask(client, {"role": "tool", "tool_call_id": called.id, "content": "mild " * (500 + 100 * (k % 5))},
                  tools=TOOLS)  # raises on a refusal
    sent = anthropic.chat_requests()
    assert len(sent) == 6 + 2 * 8
    assert all(r.messages[0]["role"] == "user" for r in sent)


@pytest.mark.parametrize("overflow", ["drop", "marker", "summarize"])
async def test_a_tool_loop_longer_than_claudes_window_sends_its_question_first(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic, overflow: str
) -> None:
    """One question, then calls and large results until the exchange alone outgrows the window (an
    agent at work, its client sending only each new result): the kept turns are the newest calls
    and results, and the question goes before them, verbatim. The agent's task is not left out for
    its own tool calls (nor only in a summary's words), and what Claude gets opens with the user
    (the fake, as the Messages API, refuses anything else)."""
    config = claude_config(storage, anthropic, context_window=2000, overflow=overflow, calibrate_tokens=False,
                           summaries=overflow == "summarize")
    anthropic.summarizer = lambda _: Reply(text="The user set a task; the assistant is checking cities.")
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("agent")
    task = "TASK-7781: find the mildest of the cities I named, checking each one's weather."
    anthropic.enqueue(Reply(text="Checking.", tool_uses=[ToolUse("weather", {"city": "c0"}, "toolu_0")]))
    asked = await ask(client, user(task), tools=TOOLS)
    for k in range(1, 9):
        [called] = asked.choices[0].message.tool_calls
        anthropic.enqueue(Reply(text="Checking.", tool_uses=[ToolUse("weather", {"city": f"c{k}"}, f"toolu_{k}")]))
        asked = await ask(client, {"role": "tool", "tool_call_id": called.id, "content": "mild " * 300},
                          tools=TOOLS)  # raises on a refusal
    sent = anthropic.chat_requests()
    assert len(sent) == 9
    assert len(sent[-1].messages) < 1 + 2 * 8  # the exchange did not fit whole
    for request in sent:
        first = request.messages[0]
        assert first["role"] == "user"
        text = first["content"] if isinstance(first["content"], str) else first["content"][0]["text"]
        assert text == task


# --- streaming -----------------------------------------------------------------------------------


async def test_streaming_is_translated_back_and_the_whole_turn_is_stored(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    config = claude_config(storage, anthropic)
    proxy: Proxy = await start_proxy(config)
    client = proxy.client("s1")
    answer = "Paris is the capital of France, on the Seine."
    anthropic.enqueue(Reply(text=answer, input_tokens=50, output_tokens=12),
                      Reply(text="Checking.", tool_uses=[ToolUse("weather", {"city": "Paris"}, "toolu_02")]),
                      Reply(text="Mild."))
    stream = await ask(client, user("Capital of France?"), stream=True)
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1, "not streamed in pieces"
    assert "".join(pieces) == answer
    assert anthropic.chat_requests()[0].body["stream"] is True

    # A streamed tool call arrives as OpenAI's tool_call deltas, assembled whole by the client.
    stream = await ask(client, user("And its weather?"), stream=True, tools=TOOLS)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function and delta.function.name) or ""
                entry["arguments"] += (delta.function and delta.function.arguments) or ""
    assert finish == "tool_calls"
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("toolu_02", "weather", {"city": "Paris"})]

    # The streamed turn is recorded with Claude's usage, priced by litellm.
    turns = db.rows(config, "SELECT prompt_tokens, completion_tokens, cost FROM turns ORDER BY id")
    assert tuple(turns[0][:2]) == (50, 12) and turns[0][2] > 0
    history = stored(config)
    assert history[1] == {"role": "assistant", "content": answer}
    assert history[3]["content"] == "Checking."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in history[3]["tool_calls"]] == [("toolu_02", "weather", {"city": "Paris"})]
    # The stored streamed turns are what the next request carries.
    await ask(client, {"role": "tool", "tool_call_id": "toolu_02", "content": "12 C"}, tools=TOOLS)
    assert anthropic.chat_requests()[2].messages == [
        {"role": "user", "content": text("Capital of France?")},
        {"role": "assistant", "content": text(answer)},
        {"role": "user", "content": text("And its weather?")},
        {"role": "assistant", "content": [*text("Checking."), {"type": "tool_use", "id": "toolu_02",
                                                               "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": "12 C"}]},
    ]


# --- summaries -----------------------------------------------------------------------------------


def claude_summariser(received: Received) -> Reply:
    """Memproxy's instructions arrive as Claude's system prompt, the transcript as the one user
    message; the answer keeps every FACT-n it mentions."""
    assert received.messages and received.messages[0]["role"] == "user" and len(received.messages) == 1
    transcript = received.messages[0]["content"][0]["text"]
    return Reply(text=fact_summary(sorted({int(n) for n in FACT.findall(transcript)})))


async def test_summaries_are_written_by_claude_and_sent_to_claude(
    start_proxy: StartProxy, storage: StorageConfig, anthropic: FakeAnthropic
) -> None:
    """A small window: older turns are folded by the same Claude model, and later requests carry the
    summary in Claude's system prompt instead of the folded turns."""
    config = claude_config(storage, anthropic, context_window=2000, summaries=True, overflow="summarize",
                           chunk_threshold_tokens=600, tail_turns=2)
    proxy: Proxy = await start_proxy(config)
    anthropic.window = 2000  # a Claude as small as the config says: input + max_tokens must fit it
    anthropic.summarizer = claude_summariser
    client = proxy.client("s1")
    turns = 8
    for turn in range(turns):
        await ask(client, user(f"Turn {turn}: remember FACT-{turn}. {words(60, turn)}"))
        await proxy.app[SUMMARIZER].wait_idle()
    summaries = summary_rows(config)
    assert summaries, "no summary was written"
    latest = summaries[-1]
    assert latest.model == "claude"
    assert latest.text == fact_summary(list(range(latest.covers // 2)))
    asked = anthropic.summary_requests()
    assert asked and all(r.body["model"] == "claude-haiku-4-5" for r in asked)
    assert all(r.headers["x-api-key"] == UPSTREAM_KEY for r in asked)

    await ask(client, user("What do you remember?"))
    last = anthropic.chat_requests()[-1]
    # The system prompt, then the summary: both in Claude's top-level system field.
    assert last.body["system"][0] == {"type": "text", "text": SYSTEM}
    assert len(last.body["system"]) == 2 and latest.text in last.body["system"][1]["text"]
    sent = json.dumps(last.messages)
    folded = latest.covers // 2  # the folded turns (user + assistant each) are not sent again
    assert all(f"FACT-{n}." not in sent for n in range(folded))
    assert f"FACT-{turns - 1}." in sent
    assert last.messages[0]["role"] == "user"


# --- the fake refuses what Anthropic refuses -------------------------------------------------------


@pytest.mark.parametrize(("body", "why"), [
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "assistant", "content": "Hi"}, user("Hello")]}, 'first message must use the "user"'),
    ({"messages": [{"role": "system", "content": "x"}, user("Hello")]}, 'Unexpected role "system"'),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "must be non-empty"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, user("?")]}, "without `tool_result`"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}, "unexpected `tool_use_id`"),
    ({"messages": [user("Hi")], "stream_options": {"include_usage": True}}, "stream_options: Extra inputs"),
])
def test_the_fake_refuses_what_anthropic_refuses(body: dict[str, Any], why: str) -> None:
    reason = refused({"model": "m", "max_tokens": 10, **body})
    assert reason is not None and why in reason
    assert refused({"model": "m", "max_tokens": 10, "messages": [user("Hi")]}) is None

