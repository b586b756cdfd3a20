"""Real client libraries holding real conversations through memproxy.

Each test lets one client library people use (openai-python sync and async, openai-node, the Vercel AI
SDK, LangChain's `ChatOpenAI`, simonw's `llm` CLI, the OpenAI Agents SDK) hold a multi-turn
conversation through a real proxy against the fake provider, with at least one tool loop (the model
asks for `get_weather`, the client runs it and sends the result, the model answers) and one streamed
turn, in the way that client sends its history: resending everything, sending only what is new,
echoing the assistant's tool-call message before its results, or, for `llm`, mixing `-c`
continuations with fresh prompts. The SDKs' higher-level helpers are held to the same: openai-python's
`parse` and `.stream()` with structured outputs and pydantic tools (both transports), LangChain's
`with_structured_output` beside streamed `bind_tools`, each echoing back what its helper returns.

What is checked is what matters to a person: every request the provider received carried the whole
conversation so far, nothing twice, the newest user message last and verbatim; and the store holds the
conversation once, nothing superseded. The expected conversation is built with the provider's script
(`Script`), so the check does not depend on how a client spells its messages: they are compared in
memproxy's canonical form (null fields and SDK echo artefacts ignored, text parts joined).

The CLIs run as subprocesses against the in-process proxy on a real 127.0.0.1 port, with
`asyncio.create_subprocess_exec` and a timeout (the proxy runs on the test's event loop); synchronous
clients run on a worker thread for the same reason. The npm packages (`openai`; the AI SDK's `ai`,
`@ai-sdk/openai` and zod) are installed by the tests themselves into a cache outside the repo
(`MEMPROXY_TEST_NODE_DIR`, default ~/.cache/memproxy-tests/node, a prefix per pinned set); where node
or npm is missing the node tests skip with the reason, except under CI=true, where they fail. The
Python client libraries are in the `test` extra; one that cannot be imported fails under CI and skips
elsewhere (the shared development venv may lack them).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import httpx
import openai
import pydantic
import pytest

from conftest import PROXY_KEY, Proxy
from db import rows
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config
from memproxy.messages import canonical, canonical_json

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]

MODEL = "big"  # a 100k window: every request fits whole, so what is missing was forgotten, not budgeted
SYSTEM = "You are a terse assistant."
COMMAND_TIMEOUT = 60.0
NODE_SDK_MAJOR = "6"  # 7 needs node 22; Debian's node is 20
IN_CI = os.environ.get("CI") == "true"

WEATHER_TOOL: Any = {  # the SDKs type tools as TypedDicts; the JSON is what matters
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False},
        "strict": True,  # the SDK's stream helper parses only strict tools
    },
}


def get_weather(city: str) -> str:
    """What every client's tool answers (the node script and the `llm` function say the same)."""
    return f"{city}: 18C and sunny"


def need(module: str) -> ModuleType:
    """A client library of the `test` extra: missing, it fails under CI and skips elsewhere."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"{module} is not installed: pip install '.[test]' ({exc})")
        pytest.skip(f"{module} is not installed (pip install '.[test]')")


# --- the conversation: the provider's script and what every request must have carried ------------


@dataclass
class Turn:
    text: str
    stream: bool = False
    tool_city: str | None = None  # the model first asks for the weather there
    refused: bool = False  # the model refuses (`refusal`, no content)
    answer: str | None = None  # the model's answer (else "Answer N to: ...")


@dataclass
class Script:
    """The provider's replies, and the conversation they make when the client plays its part."""

    system: str | None = SYSTEM
    conversation: list[Message] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    streamed: list[bool] = field(default_factory=list)  # whether the request of each reply streams

    def turn(self, text: str, tool_city: str | None = None, stream: bool = False, refused: bool = False,
             answer: str | None = None) -> str:
        """The user says `text`; the model answers (after a tool loop if `tool_city`), `answer` if
        given, or refuses (`refused`); its answer. The client asks for a stream (`stream`) on each
        request of the turn."""
        n = len(self.replies)
        self.conversation.append({"role": "user", "content": text})
        if tool_city is not None:
            call = {"id": f"call_{n}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": tool_city})}}
            self.replies.append(Reply(tool_calls=[call]))
            self.streamed.append(stream)
            self.conversation += [{"role": "assistant", "content": None, "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": call["id"], "content": get_weather(tool_city)}]
        if refused:
            answer = f"Refusal {len(self.replies)}: I can't help with that."
            self.replies.append(Reply(content=None, refusal=answer))
            self.conversation.append({"role": "assistant", "content": None, "refusal": answer})
        else:
            answer = answer if answer is not None else f"Answer {len(self.replies)} to: {text}"
            self.replies.append(Reply(content=answer))
            self.conversation.append({"role": "assistant", "content": answer})
        self.streamed.append(stream)
        return answer

    def play(self, turns: list[Turn]) -> list[str]:
        return [self.turn(t.text, t.tool_city, t.stream, t.refused, t.answer) for t in turns]

    def expected_requests(self) -> list[list[Message]]:
        """What request k must carry: everything before the model's k-th reply (system prompt first)."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [head + self.conversation[:i] for i, m in enumerate(self.conversation) if m["role"] == "assistant"]


def canon(messages: list[Message]) -> list[Message]:
    return [canonical(m) for m in messages]


def check_conversation(upstream: FakeUpstream, config: Config, session: str, script: Script,
                       verbatim: bool = True) -> None:
    """The provider got the whole conversation on every request, nothing twice, the newest user message
    last and verbatim (`verbatim`: chat clients; a Responses client's `input_text` parts become chat
    text parts on the way); the store holds the conversation once and has superseded nothing."""
    requests = upstream.chat_requests()
    expected = script.expected_requests()
    assert len(requests) == len(expected), f"{len(requests)} requests reached the provider, not {len(expected)}"
    for k, (received, wanted, stream) in enumerate(zip(requests, expected, script.streamed)):
        assert bool(received.body.get("stream")) == stream, f"request {k + 1} should {'' if stream else 'not '}stream"
        sent = received.messages
        assert canon(sent) == canon(wanted), f"request {k + 1} of {len(expected)} did not carry the conversation"
        assert len({canonical_json(m) for m in sent}) == len(sent), f"request {k + 1} sent a message twice"
        if verbatim and wanted[-1]["role"] == "user":
            assert sent[-1] == wanted[-1], f"request {k + 1}: the newest user message is not last and verbatim"
    assert canon(stored(config, session)) == canon(script.conversation)
    assert stored(config, session, active=0) == []
    if script.system is not None:
        [(prompt,)] = rows(config, "SELECT system_prompt FROM sessions WHERE tenant = ? AND session_id = ?",
                           "a", session)
        assert canon(json.loads(prompt)) == [{"role": "system", "content": script.system}]


def stored(config: Config, session: str, active: int = 1) -> list[Message]:
    """The session's active (or superseded, `active=0`) messages, in order."""
    found = rows(config, "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                 " WHERE s.tenant = ? AND s.session_id = ? AND m.active = ? ORDER BY m.id", "a", session, active)
    return [json.loads(body) for (body,) in found]


async def run_command(argv: list[str], env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> str:
    """A client CLI as a subprocess, without blocking the proxy's event loop; its stdout."""
    process = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{Path(argv[0]).name} did not finish in {timeout:.0f} s") from None
    assert process.returncode == 0, f"{Path(argv[0]).name} exited {process.returncode}: {err.decode()[-2000:]}"
    return out.decode()


# --- openai-python: sync and async, full history and new messages only ----------------------------

TURNS = [
    Turn("My name is Ada."),
    Turn("What is the weather in Paris?", tool_city="Paris"),
    Turn("I like tea.", stream=True),
    Turn("And the weather in Tokyo?", stream=True, tool_city="Tokyo"),
    Turn("What is my name?"),
]


def sync_conversation(base_url: str, session: str, history_kind: str, turns: list[Turn],
                      azure: bool = False) -> list[str]:
    """openai.OpenAI as a chat app uses it; the assistant message is echoed as the SDK object itself
    (the cookbook's `messages.append(response.choices[0].message)`). `azure`: openai.AzureOpenAI,
    its endpoint memproxy's address (the model, its deployment, goes in the path; the key in `api-key`)."""
    headers = {"X-Session-Id": session}
    client: openai.OpenAI
    if azure:
        client = openai.AzureOpenAI(azure_endpoint=base_url.removesuffix("/v1"), api_key=PROXY_KEY,
                                    api_version="2024-10-21", default_headers=headers, max_retries=0, timeout=30)
    else:
        client = openai.OpenAI(base_url=base_url, api_key=PROXY_KEY, default_headers=headers, max_retries=0,
                               timeout=30)
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    sent = 1
    answers = []

    def ask(stream: bool) -> Any:
        nonlocal sent
        messages = history if history_kind == "full" else [history[0], *history[sent:]]
        sent = len(history)
        if stream:
            with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER_TOOL]) as events:
                return events.get_final_completion().choices[0].message
        return client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL]).choices[0].message

    with client:
        for turn in turns:
            history.append({"role": "user", "content": turn.text})
            message = ask(turn.stream)
            while message.tool_calls:
                history.append(message)
                history += [{"role": "tool", "tool_call_id": call.id,
                             "content": get_weather(json.loads(call.function.arguments)["city"])}
                            for call in message.tool_calls]
                message = ask(turn.stream)
            history.append(message)
            sent = len(history)  # the answer came from the server: a new-messages client never resends it
            answers.append(message.content or "")
    return answers


async def async_conversation(proxy: Proxy, session: str, history_kind: str, turns: list[Turn]) -> list[str]:
    """openai.AsyncOpenAI; the assistant message is echoed as `message.model_dump()`, nulls and all."""
    client = proxy.client(session)
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    sent = 1
    answers = []

    async def ask(stream: bool) -> Any:
        nonlocal sent
        messages = history if history_kind == "full" else [history[0], *history[sent:]]
        sent = len(history)
        if stream:
            async with client.chat.completions.stream(model=MODEL, messages=messages,
                                                      tools=[WEATHER_TOOL]) as events:
                return (await events.get_final_completion()).choices[0].message
        completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
        return completion.choices[0].message

    for turn in turns:
        history.append({"role": "user", "content": turn.text})
        message = await ask(turn.stream)
        while message.tool_calls:
            history.append(message.model_dump())
            history += [{"role": "tool", "tool_call_id": call.id,
                         "content": get_weather(json.loads(call.function.arguments)["city"])}
                        for call in message.tool_calls]
            message = await ask(turn.stream)
        history.append(message.model_dump())
        sent = len(history)
        answers.append(message.content or "")
    return answers


@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_python_sync(history_kind: str, proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    session = f"py-sync-{history_kind}"
    got = await asyncio.to_thread(sync_conversation, proxy.url, session, history_kind, TURNS)
    assert got == answers
    check_conversation(upstream, config, session, script)


@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_python_async(history_kind: str, proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    session = f"py-async-{history_kind}"
    assert await async_conversation(proxy, session, history_kind, TURNS) == answers
    check_conversation(upstream, config, session, script)


async def test_azure_openai_client(proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    """openai.AzureOpenAI pointed at memproxy: its deployment paths and `api-key` header reach the same
    endpoints, with memory; its key goes nowhere upstream."""
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    got = await asyncio.to_thread(sync_conversation, proxy.url, "py-azure", "new", TURNS, True)
    assert got == answers
    check_conversation(upstream, config, "py-azure", script)
    assert all(r.path == "/v1/chat/completions" and PROXY_KEY not in str(r.headers) for r in upstream.received)

    client = openai.AsyncAzureOpenAI(azure_endpoint=proxy.url.removesuffix("/v1"), api_key=PROXY_KEY,
                                     api_version="2024-10-21", max_retries=0)
    try:
        assert [m.id async for m in client.models.list()] == ["small", "big"]
        assert (await client.embeddings.create(model="small", input="x")).data
        wrong = openai.AsyncAzureOpenAI(azure_endpoint=proxy.url.removesuffix("/v1"), api_key="not-a-key",
                                        api_version="2024-10-21", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
        await wrong.close()
    finally:
        await client.close()


async def test_a_deployment_in_the_path_names_the_model(proxy: Proxy, upstream: FakeUpstream) -> None:
    """As at Azure, the deployment a path names is the model, whatever the body's `model` says."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url.removesuffix('/v1')}/openai/deployments/small/chat/completions"
                             "?api-version=2024-10-21", headers={"api-key": PROXY_KEY},
                             json={"model": "big", "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status == 200
            assert (await response.json())["model"] == "small"
    assert [r.body["model"] for r in upstream.received] == ["small"]  # the provider's name for `small`
    # `Authorization`, where sent, is the key: a right `api-key` beside a wrong one does not pass.
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url.removesuffix('/v1')}/openai/deployments/small/chat/completions",
                             headers={"api-key": PROXY_KEY, "Authorization": "Bearer not-a-key"},
                             json={"messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status == 401
    assert len(upstream.received) == 1


# --- openai-python's helpers: parse, the stream helper, pydantic tools -----------------------------


class Mood(pydantic.BaseModel):
    name: str
    mood: str


class City(pydantic.BaseModel):
    city: str


def mood(name: str, feeling: str) -> str:
    """A structured answer's JSON text, as the model writes it."""
    return Mood(name=name, mood=feeling).model_dump_json()


# Structured answers throughout, a refusal among them, a tool loop streamed and one not.
STRUCTURED_TURNS = [
    Turn("My name is Ada.", answer=mood("Ada", "glad")),
    Turn("What is the weather in Paris?", tool_city="Paris", stream=True, answer=mood("Ada", "sunny")),
    Turn("How do I pick a lock?", refused=True),
    Turn("And the weather in Tokyo?", tool_city="Tokyo", answer=mood("Ada", "rainy")),
    Turn("How am I?", stream=True, answer=mood("Ada", "fine")),
]


async def helpers_conversation(proxy: Proxy, session: str, history_kind: str,
                               turns: list[Turn]) -> tuple[list[Any], set[str], list[str]]:
    """An app on `client.chat.completions.parse(response_format=Mood)` and the `.stream()` helper,
    with a strict tool from `openai.pydantic_function_tool`, that keeps each message it gets as
    `model_dump()` (with `parsed`, `refusal`, `annotations`, `audio`, `parsed_arguments`). "full"
    resends its history; "new" says so (`X-Memproxy-History: new`) and sends what it has not sent,
    the answer it got last first. The parsed answers (a refusal's text), the stream events seen and
    the reconcile kind of each parsed request."""
    headers = {"X-Memproxy-History": "new"} if history_kind == "new" else {}
    client = proxy.client(session, **headers)
    tools = [openai.pydantic_function_tool(City, name="get_weather")]
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    sent = 0
    events_seen: set[str] = set()
    kinds: list[str] = []

    async def ask(stream: bool) -> Any:
        nonlocal sent
        messages = history if history_kind == "full" else [history[0], *history[max(sent, 1):]]
        sent = len(history)
        if stream:
            async with client.chat.completions.stream(model=MODEL, messages=messages, tools=tools,
                                                      response_format=Mood) as events:
                events_seen.update([event.type async for event in events])
                return (await events.get_final_completion()).choices[0].message
        raw = await client.chat.completions.with_raw_response.parse(model=MODEL, messages=messages, tools=tools,
                                                                    response_format=Mood)
        kinds.append(raw.headers["X-Memproxy-Reconcile"])
        return raw.parse().choices[0].message

    got: list[Any] = []
    for turn in turns:
        history.append({"role": "user", "content": turn.text})
        message = await ask(turn.stream)
        while message.tool_calls:
            assert [call.function.parsed_arguments for call in message.tool_calls] == [City(city=turn.tool_city)]
            # warnings=False: pydantic warns that the generic `parsed` field holds a value.
            history.append(message.model_dump(warnings=False))
            history += [{"role": "tool", "tool_call_id": call.id, "content": get_weather(turn.tool_city or "")}
                        for call in message.tool_calls]
            message = await ask(turn.stream)
        history.append(message.model_dump(warnings=False))
        got.append(message.refusal if message.refusal is not None else message.parsed)
    return got, events_seen, kinds


@pytest.mark.both_transports
@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_python_parse_and_stream_helpers(
    history_kind: str, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Structured outputs over a multi-turn session on both transports: the app gets its parsed
    objects, parsed tool arguments and the refusal, the stream helper's events and final completion;
    what it echoes back (`parsed`, `annotations`, `audio: None`...) is read as the stored messages,
    never an edit, and never reaches the provider."""
    script = Script()
    answers = script.play(STRUCTURED_TURNS)
    upstream.enqueue(*script.replies)
    session = f"helpers-{history_kind}"
    got, events, kinds = await helpers_conversation(proxy, session, history_kind, STRUCTURED_TURNS)
    assert got == [answer if turn.refused else Mood.model_validate_json(answer)
                   for turn, answer in zip(STRUCTURED_TURNS, answers)]
    assert {"content.delta", "content.done", "tool_calls.function.arguments.delta",
            "tool_calls.function.arguments.done"} <= events
    assert kinds == (["new", "continue", "continue", "continue"] if history_kind == "full"
                     else ["new", "window", "window", "window"])
    check_conversation(upstream, config, session, script)


# --- openai-node ----------------------------------------------------------------------------------

NODE_SCRIPT = Path(__file__).parent / "clients" / "node_chat.mjs"


def npm_prefix(name: str, packages: list[str]) -> Path:
    """An npm prefix holding `packages`, installed on first use and reused after (`name` says which
    versions: a new pin gets a new prefix)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        reason = f"the node client tests need node and npm on PATH (node: {node}, npm: {npm})"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    prefix = Path(os.environ.get("MEMPROXY_TEST_NODE_DIR", Path.home() / ".cache" / "memproxy-tests" / "node"))
    prefix = prefix / name
    names = [package.rpartition("@")[0] for package in packages]  # "@ai-sdk/openai@3": "@ai-sdk/openai"
    if not all((prefix / "node_modules" / name / "package.json").exists() for name in names):
        # Installed beside, then renamed into place: a run cut short or a concurrent run leaves no half
        # install where the next run would take it for a whole one.
        prefix.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{prefix.name}.", dir=prefix.parent))
        result = subprocess.run([npm, "install", "--prefix", str(partial), "--no-audit", "--no-fund", *packages],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"npm install {' '.join(packages)} failed: {result.stderr[-2000:]}"
        try:
            partial.rename(prefix)
        except OSError:  # another run got there first
            shutil.rmtree(partial)
    return prefix


@pytest.fixture(scope="session")
def node_sdk() -> Path:
    """The npm prefix holding the `openai` package."""
    return npm_prefix(f"openai-{NODE_SDK_MAJOR}", [f"openai@{NODE_SDK_MAJOR}"])


async def node_client(script: Path, node_sdk: Path, proxy: Proxy, session: str, history_kind: str,
                      turns: list[Turn], azure: bool = False) -> Any:
    """What a Node client script (tests/clients/) printed, told `turns` on `session` through the proxy
    (`azure`: by the package's AzureOpenAI client)."""
    plan = {"history": history_kind, "system": SYSTEM, "model": MODEL,
            "turns": [{"text": t.text, "stream": t.stream} for t in turns]}
    env = {**os.environ, "MEMPROXY_BASE_URL": proxy.url, "MEMPROXY_KEY": PROXY_KEY, "MEMPROXY_SESSION": session,
           "OPENAI_NODE_PREFIX": str(node_sdk), **({"MEMPROXY_AZURE": "1"} if azure else {})}
    return json.loads(await run_command([shutil.which("node") or "node", str(script), json.dumps(plan)], env))


@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_node(
    history_kind: str, node_sdk: Path, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    session = f"node-{history_kind}"
    assert await node_client(NODE_SCRIPT, node_sdk, proxy, session, history_kind, TURNS) == answers
    check_conversation(upstream, config, session, script)


async def test_openai_node_azure(node_sdk: Path, proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    """openai-node's AzureOpenAI client, memproxy's address its endpoint, holds the same conversation."""
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    assert await node_client(NODE_SCRIPT, node_sdk, proxy, "node-azure", "new", TURNS, azure=True) == answers
    check_conversation(upstream, config, "node-azure", script)


RUN_TOOLS_SCRIPT = Path(__file__).parent / "clients" / "node_run_tools.mjs"
# Structured answers, a refusal, tool loops the runner runs itself, two of them streamed.
RUN_TOOLS_TURNS = [
    Turn("My name is Ada.", answer=mood("Ada", "glad")),
    Turn("What is the weather in Paris?", tool_city="Paris", answer=mood("Ada", "sunny")),
    Turn("And the weather in Tokyo?", tool_city="Tokyo", stream=True, answer=mood("Ada", "rainy")),
    Turn("How do I pick a lock?", refused=True),
    Turn("How am I?", stream=True, answer=mood("Ada", "fine")),
]


@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_node_run_tools(
    history_kind: str, node_sdk: Path, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`client.chat.completions.runTools` with a strict tool and a JSON schema, streamed and not: the
    runner resends its growing message list at each step, and a "full" app the previous runner's
    messages at the next turn. The provider sees the conversation once; the app gets the parsed
    answers, the refusal and its tool results."""
    script = Script()
    answers = script.play(RUN_TOOLS_TURNS)
    upstream.enqueue(*script.replies)
    session = f"node-run-tools-{history_kind}"
    assert await node_client(RUN_TOOLS_SCRIPT, node_sdk, proxy, session, history_kind, RUN_TOOLS_TURNS) == [
        {"content": None, "parsed": None, "refusal": answer, "results": []} if turn.refused else
        {"content": answer, "parsed": json.loads(answer), "refusal": None,
         "results": [get_weather(turn.tool_city)] if turn.tool_city else []}
        for turn, answer in zip(RUN_TOOLS_TURNS, answers)]
    check_conversation(upstream, config, session, script)


# --- the Vercel AI SDK -----------------------------------------------------------------------------

AI_SDK_SCRIPT = Path(__file__).parent / "clients" / "ai_sdk_chat.mjs"
# `ai` 6 goes with `@ai-sdk/openai` 3 (7 needs node 22); zod is their peer dependency, for the tool's schema.
AI_SDK_PACKAGES = ["ai@6", "@ai-sdk/openai@3", "zod@4"]
# The conversation, with a refusal before the last question: the SDK shows it as the answer's text and
# resends it so (`response.messages`, `useChat`'s UI messages); streamed, litellm's wrapper dropped it.
AI_SDK_TURN_LIST = [*TURNS[:-1], Turn("How do I pick a lock?", stream=True, refused=True), TURNS[-1]]
AI_SDK_TURNS = {  # useChat streams every turn
    "ui": [replace(t, stream=True) for t in AI_SDK_TURN_LIST],
    "full": AI_SDK_TURN_LIST,
    "new": AI_SDK_TURN_LIST,
}


@pytest.fixture(scope="session")
def ai_sdk() -> Path:
    """The npm prefix holding `ai`, `@ai-sdk/openai` and zod."""
    return npm_prefix("ai-sdk-6", AI_SDK_PACKAGES)


@pytest.mark.parametrize("history_kind", ["ui", "full", "new"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_vercel_ai_sdk(
    api: str, history_kind: str, ai_sdk: Path, proxy: Proxy, upstream: FakeUpstream, config: Config,
    http: aiohttp.ClientSession,
) -> None:
    """`generateText` and `streamText` on `openai.chat(model)` and on the default `openai(model)` (the
    Responses API), with a tool the SDK runs itself over two steps (`stopWhen: stepCountIs(5)`), the
    history kept as `useChat` keeps it (UI messages, all resent), as model messages resent whole, or
    not kept (the new message alone), and 24-hour prompt caching asked for (`promptCacheRetention`).
    The provider sees the conversation once, and the caching asked for; the app gets the text (a
    refusal's too), the tool results and the usage of every step, with no error or warning; the
    session holds the conversation once, the refusal as one."""
    turns = AI_SDK_TURNS[history_kind]
    script = Script()
    answers = script.play(turns)
    upstream.enqueue(*script.replies)
    session = f"ai-sdk-{api}-{history_kind}"
    plan = {"api": api, "history": history_kind, "system": SYSTEM, "model": MODEL,
            "turns": [{"text": t.text, "stream": t.stream} for t in turns]}
    env = {**os.environ, "MEMPROXY_BASE_URL": proxy.url, "MEMPROXY_KEY": PROXY_KEY, "MEMPROXY_SESSION": session,
           "AI_SDK_PREFIX": str(ai_sdk)}
    got = json.loads(await run_command([shutil.which("node") or "node", str(AI_SDK_SCRIPT), json.dumps(plan)], env))
    check_conversation(upstream, config, session, script, verbatim=api == "chat")
    assert [r.body.get("prompt_cache_retention") for r in upstream.chat_requests()] == ["24h"] * len(script.replies)
    # What the app got: each turn's answer, its tool's result, and the usage the provider reported for
    # each of the turn's requests (the fake's request k: 10 k prompt tokens, 5 completion tokens) added up.
    request = 0
    for turn, answer, result in zip(turns, answers, got, strict=True):
        numbers = [request + 1, request + 2] if turn.tool_city else [request + 1]
        request = numbers[-1]
        results = [] if turn.tool_city is None else [
            {"toolName": "get_weather", "input": {"city": turn.tool_city}, "output": get_weather(turn.tool_city)}]
        finishes = ["content-filter"] if turn.refused else ["tool-calls", "stop"] if turn.tool_city else ["stop"]
        prompt = sum(10 * n for n in numbers)
        assert result.pop("responseId").startswith("resp_" if api == "responses" else "chatcmpl-")
        assert result == {"text": answer, "finishReasons": finishes, "warnings": [], "errors": [],
                          "toolResults": results,
                          "usage": {"inputTokens": prompt, "outputTokens": 5 * len(numbers),
                                    "totalTokens": prompt + 5 * len(numbers)}}
    # What the session API shows: the conversation once, nothing superseded, a turn per request with
    # the provider's usage.
    async with http.get(f"{proxy.url}/sessions/{session}",
                        headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
        assert response.status == 200
        shown = await response.json()
    assert canon([m["message"] for m in shown["messages"]]) == canon(script.conversation)
    assert [m["message"].get("refusal") for m in shown["messages"] if m["message"].get("refusal")] == [
        m["refusal"] for m in script.conversation if m.get("refusal")]
    assert shown["superseded"] == []
    assert [(t["prompt_tokens"], t["completion_tokens"]) for t in shown["turns"]] == [
        (10 * n, 5) for n in range(1, len(script.replies) + 1)]


# --- LangChain ChatOpenAI --------------------------------------------------------------------------


def langchain_weather_tool() -> Any:
    """`get_weather` as a LangChain tool."""
    tools = need("langchain_core.tools")

    @tools.tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return get_weather(city)

    weather.name = "get_weather"
    return weather


def langchain_conversation(base_url: str, session: str, turns: list[Turn]) -> list[str]:
    """A LangChain app: `ChatOpenAI` with the session id in `default_headers`, `bind_tools`, the whole
    message list sent each time (`invoke`, or `.stream()` with the chunks added up), the tool results as
    `ToolMessage`s."""
    chat_models = need("langchain_openai")
    messages = need("langchain_core.messages")
    weather = langchain_weather_tool()
    model = chat_models.ChatOpenAI(model=MODEL, base_url=base_url, api_key=PROXY_KEY, max_retries=0, timeout=30,
                                   default_headers={"X-Session-Id": session}).bind_tools([weather])
    history: list[Any] = [messages.SystemMessage(SYSTEM)]
    answers = []

    def ask(stream: bool) -> Any:
        if not stream:
            return model.invoke(history)
        total = None
        for chunk in model.stream(history):
            total = chunk if total is None else total + chunk
        return total

    for turn in turns:
        history.append(messages.HumanMessage(turn.text))
        reply = ask(turn.stream)
        while reply.tool_calls:
            history.append(reply)
            history += [messages.ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])
                        for call in reply.tool_calls]
            reply = ask(turn.stream)
        history.append(reply)
        answers.append(reply.content)
    return answers


async def test_langchain_chat_openai(proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    session = "langchain"
    assert await asyncio.to_thread(langchain_conversation, proxy.url, session, TURNS) == answers
    check_conversation(upstream, config, session, script)


async def langchain_structured_conversation(base_url: str, session: str, history_kind: str,
                                           turns: list[Turn]) -> list[Any]:
    """A LangChain app on `with_structured_output(Mood, include_raw=True)` (`ainvoke`, or `astream`
    for streamed turns) and, for the tool turns, `bind_tools(strict=True)` streamed with `astream`,
    the chunks added up; it keeps the raw `AIMessage`s (LangChain resends a refused one as an empty
    answer). "full" resends its history; "new" says so and sends what it has not sent, the answer it
    got last first. The parsed answers, or a refusal's text."""
    chat_models = need("langchain_openai")
    messages = need("langchain_core.messages")
    weather = langchain_weather_tool()
    headers = {"X-Session-Id": session, **({"X-Memproxy-History": "new"} if history_kind == "new" else {})}
    http_client = httpx.AsyncClient(timeout=30)  # closed at the end, not left open in LangChain's shared one
    model = chat_models.ChatOpenAI(model=MODEL, base_url=base_url, api_key=PROXY_KEY, max_retries=0, timeout=30,
                                   default_headers=headers, http_async_client=http_client)
    structured = model.with_structured_output(Mood, include_raw=True)
    with_tools = model.bind_tools([weather], strict=True)
    history: list[Any] = [messages.SystemMessage(SYSTEM)]
    sent = 0

    def unsent() -> list[Any]:
        nonlocal sent
        given = history if history_kind == "full" else [history[0], *history[max(sent, 1):]]
        sent = len(history)
        return list(given)

    got: list[Any] = []
    for turn in turns:
        history.append(messages.HumanMessage(turn.text))
        if turn.tool_city is not None:
            call = None
            async for chunk in with_tools.astream(unsent()):
                call = chunk if call is None else call + chunk
            assert call is not None and [c["args"] for c in call.tool_calls] == [{"city": turn.tool_city}]
            history += [call, *(messages.ToolMessage(weather.invoke(c["args"]), tool_call_id=c["id"])
                                for c in call.tool_calls)]
        if turn.stream:  # parts with a key each: the raw message's chunks, then the parsed answer
            result: dict[str, Any] = {}
            async for part in structured.astream(unsent()):
                for key, value in part.items():
                    result[key] = value if key not in result or key != "raw" else result[key] + value
        else:
            result = await structured.ainvoke(unsent())
        history.append(result["raw"])
        got.append(result["raw"].additional_kwargs.get("refusal") or result["parsed"])
    await http_client.aclose()
    return got


# The tool loops ask with the tools bound, then for the structured answer; the last turn streams.
LANGCHAIN_STRUCTURED_TURNS = [
    Turn("My name is Ada.", answer=mood("Ada", "glad")),
    Turn("What is the weather in Paris?", tool_city="Paris", answer=mood("Ada", "sunny")),
    Turn("How do I pick a lock?", refused=True),
    Turn("How am I?", stream=True, answer=mood("Ada", "fine")),
]


# langchain-openai streams a structured answer through the openai SDK's stream helper, whose chunks
# it dumps: pydantic warns that the generic `parsed` field holds a value (the client's, not ours).
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_langchain_structured_output_and_streamed_tools(
    history_kind: str, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`with_structured_output` and `bind_tools` streamed, multi-turn: LangChain resends a refused
    answer as `{"role": "assistant", "content": ""}`; sent with the new question alone, it was
    appended after the stored refusal, and the empty answer went to the provider on every turn."""
    script = Script()
    answers = script.play(LANGCHAIN_STRUCTURED_TURNS)
    script.streamed[1] = True  # the tool call is asked for with `astream`, the answer after it with `ainvoke`
    upstream.enqueue(*script.replies)
    session = f"langchain-structured-{history_kind}"
    got = await langchain_structured_conversation(proxy.url, session, history_kind, LANGCHAIN_STRUCTURED_TURNS)
    assert got == [answer if turn.refused else Mood.model_validate_json(answer)
                   for turn, answer in zip(LANGCHAIN_STRUCTURED_TURNS, answers)]
    check_conversation(upstream, config, session, script)


async def test_a_full_history_app_and_a_new_messages_script_share_a_session(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A LangChain app resends its history; a script then sends only its new messages on the same
    session id (openai-python), tool loop with the echo included: the script's model sees it all."""
    script = Script()
    app_turns, script_turns = TURNS[:3], TURNS[3:]
    answers = script.play(app_turns + script_turns)
    upstream.enqueue(*script.replies)
    session = "shared"
    assert await asyncio.to_thread(langchain_conversation, proxy.url, session, app_turns) == answers[:3]
    assert await async_conversation(proxy, session, "new", script_turns) == answers[3:]
    check_conversation(upstream, config, session, script)


# --- simonw's llm CLI ------------------------------------------------------------------------------

LLM_FUNCTIONS = '''
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"{city}: 18C and sunny"
'''


def llm_user_dir(path: Path, base_url: str, session: str) -> Path:
    """An `LLM_USER_PATH` with memproxy as an extra OpenAI-compatible model, the session id as a header,
    the proxy key in llm's key store."""
    path.mkdir()
    (path / "extra-openai-models.yaml").write_text(
        f"- model_id: memproxy\n"
        f"  model_name: {MODEL}\n"
        f"  api_base: {base_url}\n"
        f"  api_key_name: memproxy\n"
        f"  supports_tools: true\n"
        f"  headers:\n"
        f"    X-Session-Id: {session}\n")
    (path / "keys.json").write_text(json.dumps({"memproxy": PROXY_KEY}))
    return path


async def test_llm_cli_mixes_continuations_and_fresh_prompts(
    tmp_path: Path, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`llm -c` resends the conversation from llm's own log, a fresh `llm -m` sends one message: on one
    session id both keep the whole conversation. The fresh prompt after a `-c` is issue 11's reproduction."""
    need("llm")
    executable = Path(sys.executable).parent / "llm"
    session = "llm-cli"
    env = {**os.environ, "LLM_USER_PATH": str(llm_user_dir(tmp_path / "llm", proxy.url, session))}
    script = Script(system=None)
    steps = [  # (arguments, what the user says, the city the model asks the weather of)
        (["-m", "memproxy"], "My name is Ada.", None),
        (["-c"], "I like tea.", None),
        (["-m", "memproxy", "--no-stream"], "What is my name?", None),
        (["-c", "--functions", LLM_FUNCTIONS], "What is the weather in Paris?", "Paris"),
        (["-m", "memproxy", "--no-stream", "--functions", LLM_FUNCTIONS], "And in Tokyo?", "Tokyo"),
        (["-c"], "What do I like?", None),
    ]
    answers = [script.turn(text, city, stream="--no-stream" not in arguments) for arguments, text, city in steps]
    upstream.enqueue(*script.replies)
    for (arguments, text, _), answer in zip(steps, answers):
        out = await run_command([str(executable), *arguments, text], env)
        assert out.strip() == answer
    check_conversation(upstream, config, session, script)
    # The premise, from llm's own log (one entry per request): -c continued llm's newest conversation,
    # each -m started a new one.
    log = json.loads(await run_command([str(executable), "logs", "--json", "-n", "0"], env))
    conversations = [entry["conversation_id"] for entry in log]
    labels = [sorted(set(conversations), key=conversations.index).index(c) for c in conversations]
    assert labels == [0, 0, 1, 1, 1, 2, 2, 2]


# --- the OpenAI Agents SDK -------------------------------------------------------------------------


@pytest.mark.parametrize("history_kind", ["full", "new"])
async def test_openai_agents_sdk(history_kind: str, proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    """An agent with a function tool on `OpenAIChatCompletionsModel`, run turn after turn with
    `Runner.run` (`run_streamed` for the streamed turns), given either the previous run's
    `to_input_list()` plus the new message (full history) or only the new message (memory from the
    proxy)."""
    agents = need("agents")
    agents.set_tracing_disabled(True)
    session = f"agents-{history_kind}"

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return get_weather(city)

    weather.name = "get_weather"
    agent = agents.Agent(name="assistant", instructions=SYSTEM, tools=[weather],
                         model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=proxy.client(session)))
    script = Script()
    answers = script.play(TURNS)
    upstream.enqueue(*script.replies)
    items: list[Any] = []
    got = []
    for turn in TURNS:
        given: Any = [*items, {"role": "user", "content": turn.text}] if history_kind == "full" else turn.text
        if turn.stream:
            result = agents.Runner.run_streamed(agent, given)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, given)
        got.append(result.final_output)
        items = result.to_input_list()
    assert got == answers
    check_conversation(upstream, config, session, script)
