"""Issue 11: memory never vanishes on a guess.

The two reproductions from the issue (a new-messages client whose tool loop echoes the assistant's
call before its results, then sends a plain message; simonw's `llm` resending its log with `-c`, then a
fresh one-message prompt), echoes and resent tails recognised (SDK echo artefacts, tool arguments
re-serialised as LangChain does), ambiguous prefixes appended, and the superseding that does happen
made visible (header, one log line without content). The real proxy, the official SDK as the client,
the fake provider; each test on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from typing import Any

import httpx
import openai
import pytest

from conftest import Proxy
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, chat, complete, user
from memproxy.config import Config
from memproxy.messages import ROOT_HASH, chain_hash, loose_json, loosely_equal
from memproxy.redact import session_digest
from test_sessions import assert_chain_consistent, stored

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]


def call(call_id: str, city: str, spacing: tuple[str, str] = (",", ":")) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city}, separators=spacing)}}


def result(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def calls_message(*calls: dict[str, Any]) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def assert_no_duplicates(messages: list[Message]) -> None:
    """No message sent or stored twice: every tool call id once, every user text once (the tests
    below never repeat one on purpose)."""
    texts = [json.dumps(m, sort_keys=True) for m in messages]
    assert len(texts) == len(set(texts)), messages


# --- the two reproductions ------------------------------------------------------------------------


async def test_new_messages_tool_loop_with_the_call_echoed_then_a_plain_message_keeps_everything(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    completion, headers = await complete(client, [user("weather in Paris?")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "new"
    # The natural shape: the assistant's message as the SDK returned it (with its echo artefacts:
    # `refusal: None`, `annotations`, ...), then the tool result.
    echoed = completion.choices[0].message.model_dump(exclude_unset=False)
    reply, headers = await chat(client, [echoed, result("call_1", "18C")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "window"
    first = [user("weather in Paris?"), calls_message(call("call_1", "Paris")), result("call_1", "18C"),
             assistant(reply)]
    assert stored(config, active=None) == first

    # Then a plain new message: before issue 11 this read as an edit at 0 and superseded everything.
    reply, headers = await chat(client, [user("and tomorrow?")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert headers["X-Memproxy-Superseded"] == "0"
    history = first + [user("and tomorrow?"), assistant(reply)]
    assert stored(config) == history and stored(config, active=0) == []
    sent = upstream.last().messages
    assert sent[0] == user("weather in Paris?") and sent[-1] == user("and tomorrow?")
    assert len(sent) == len(history) - 1
    assert_no_duplicates(sent)
    assert_chain_consistent(config)


async def test_llm_cli_continuation_then_a_fresh_prompt_keeps_everything(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`llm -c` resends the conversation from its own log; a plain `llm` prompt sends one message."""
    client = proxy.client()
    log: list[Message] = []
    for prompt in ("My name is Ada.", "I like tea."):  # `llm -c`: everything so far, then the prompt
        reply, _ = await chat(client, [*log, user(prompt)])
        log += [user(prompt), assistant(reply)]
    reply, headers = await chat(client, [user("What is my name?")])  # a fresh `llm` prompt
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert upstream.last().messages == [*log, user("What is my name?")]
    assert headers["X-Memproxy-Superseded"] == "0"
    # `llm -c` now continues the fresh conversation of its log: that one exchange, then the prompt.
    reply2, headers = await chat(client, [user("What is my name?"), assistant(reply), user("And what do I like?")])
    assert headers["X-Memproxy-Reconcile"] == "window"
    history = [*log, user("What is my name?"), assistant(reply), user("And what do I like?"), assistant(reply2)]
    assert upstream.last().messages == history[:-1]
    assert stored(config) == history and stored(config, active=0) == []
    assert_chain_consistent(config)


# --- echoes and resent tails ----------------------------------------------------------------------


async def test_resent_tail_with_new_history_header_is_stored_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`X-Memproxy-History: new` used to store a resent tail twice; an echoed stored tail is stripped."""
    client = proxy.client(**{"X-Memproxy-History": "new"})
    reply1, _ = await chat(client, [user("q1")])
    reply2, headers = await chat(client, [assistant(reply1), user("q2")])
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert upstream.last().messages == [user("q1"), assistant(reply1), user("q2")]
    reply3, headers = await chat(client, [user("q1")])  # the header: a repeated first message is new
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert stored(config) == [user("q1"), assistant(reply1), user("q2"), assistant(reply2), user("q1"),
                              assistant(reply3)]
    assert_chain_consistent(config)


async def test_tool_arguments_reserialised_by_the_client_are_not_an_edit(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """LangChain sends tool-call arguments back through `json.dumps` (spaces after `,` and `:`): the
    same call, not an edit; the stored form stays (stored hashes must stay valid)."""
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    await chat(client, [user("weather in Paris?")], tools=TOOLS)
    spaced = calls_message(call("call_1", "Paris", spacing=(", ", ": ")))
    history = [user("weather in Paris?"), spaced, result("call_1", "18C")]
    reply, headers = await chat(client, history, tools=TOOLS)  # a full resend, spelt differently
    assert headers["X-Memproxy-Reconcile"] == "continue"
    assert headers["X-Memproxy-Superseded"] == "0"
    history += [assistant(reply), user("thanks")]
    reply, headers = await chat(client, history, tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "continue"
    assert stored(config, active=0) == []
    assert stored(config) == [user("weather in Paris?"), calls_message(call("call_1", "Paris")),
                              result("call_1", "18C"), *history[3:], assistant(reply)]
    # An echo of the call alone, re-serialised, before a second result: recognised too.
    upstream.enqueue(Reply(tool_calls=[call("call_2", "Oslo")]))
    await chat(client, [user("and Oslo?")], tools=TOOLS)
    reply, headers = await chat(client, [calls_message(call("call_2", "Oslo", spacing=(", ", ": "))),
                                         result("call_2", "-3C")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert_no_duplicates(stored(config, active=None))
    assert_chain_consistent(config)


async def test_empty_arguments_sent_back_as_an_empty_object_are_the_same_call(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A tool without parameters: llama.cpp and older vLLM parsers give its arguments as "", and
    LangChain sends them back as "{}". The same call, not an edit (which superseded every such
    call of a tool loop)."""
    client = proxy.client()
    bare = {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    upstream.enqueue(Reply(tool_calls=[bare]))
    await chat(client, [user("what time is it?")], tools=TOOLS)
    resent = {**bare, "function": {"name": "get_time", "arguments": "{}"}}
    reply, headers = await chat(client, [user("what time is it?"), calls_message(resent), result("call_t", "12:00")],
                                tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert stored(config) == [user("what time is it?"), calls_message(bare), result("call_t", "12:00"),
                              assistant(reply)]
    assert stored(config, active=0) == []


async def test_edit_behind_reserialised_arguments_forks_where_the_text_changed(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    await chat(client, [user("weather in Paris?")], tools=TOOLS)
    history = [user("weather in Paris?"), calls_message(call("call_1", "Paris")), result("call_1", "18C")]
    reply, _ = await chat(client, history, tools=TOOLS)
    history += [assistant(reply), user("q2")]
    reply2, _ = await chat(client, history, tools=TOOLS)
    spaced = [history[0], calls_message(call("call_1", "Paris", spacing=(", ", ": "))), *history[2:4]]
    reply3, headers = await chat(client, [*spaced, user("q2, edited")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "edit"
    assert headers["X-Memproxy-Superseded"] == "2"  # q2 and its answer; the call kept as stored
    assert stored(config) == [*history[:4], user("q2, edited"), assistant(reply3)]
    assert stored(config, active=0) == [user("q2"), assistant(reply2)]
    assert_chain_consistent(config)


async def test_answers_resent_with_their_whitespace_trimmed_are_the_stored_ones(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Chat UIs trim the final newline of an answer before they resend the history: the same
    answer, not an edit, and never the whole history again."""
    client = proxy.client()
    history = [user("q1")]
    for n in range(1, 4):
        upstream.enqueue(Reply(content=f"Answer {n}\n\n"))
        reply, headers = await chat(client, history)
        assert headers["X-Memproxy-Reconcile"] == ("new" if n == 1 else "continue")
        sent = upstream.last().messages  # the stored forms, each message once
        assert [(m["role"], m["content"].strip()) for m in sent] == [(m["role"], m["content"]) for m in history]
        history += [assistant(reply.strip()), user(f"q{n + 1}")]
    assert stored(config, active=0) == []
    assert [m["content"] for m in stored(config)] == ["q1", "Answer 1\n\n", "q2", "Answer 2\n\n", "q3",
                                                      "Answer 3\n\n"]
    assert_chain_consistent(config)


async def test_a_history_resent_in_another_unicode_form_is_the_stored_one(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client that keeps its history normalised (a UI's store, macOS input in the decomposed
    form) resends "café" as other code points than it first sent or was answered with: the same
    text, not new messages. Read as new, the whole history was stored and sent twice."""
    decomposed = "Un cafe\u0301 cre\u0300me."
    upstream.enqueue(Reply(content="Voila\u0300 votre cafe\u0301."))
    reply, _ = await chat(proxy.client(), [user(decomposed)])
    history = [user(unicodedata.normalize("NFC", decomposed)), assistant(unicodedata.normalize("NFC", reply)),
               user("Merci.")]
    _, headers = await chat(proxy.client(), history)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert stored(config) == [user(decomposed), assistant(reply), user("Merci."), assistant("reply 2")]
    assert upstream.last().messages == stored(config)[:3]  # the stored forms, each once

    # A tool's result of text beside a picture (a screenshot tool), first composed, then resent
    # decomposed with the rest of the tool loop.
    def seen(text: str) -> Message:
        return {"role": "tool", "tool_call_id": "call_1",
                "content": [{"type": "text", "text": text},
                            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}

    client = proxy.client(session="s2")
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    await chat(client, [user("Look.")], tools=TOOLS)
    reply, _ = await chat(client, [seen(unicodedata.normalize("NFC", decomposed))], tools=TOOLS)
    _, headers = await chat(client, [user("Look."), calls_message(call("call_1", "Paris")), seen(decomposed),
                                     assistant(reply), user("Merci.")], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert len(stored(config, session="s2")) == 6 and stored(config, session="s2", active=0) == []
    assert_chain_consistent(config)


async def test_a_history_resent_with_other_line_ends_is_the_stored_one(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A question first sent with CRLF line ends (a Windows client, a form post) and resent with
    LF ones, as most clients keep text: the same question. Read as new, the whole history was
    stored and sent twice."""
    client = proxy.client()
    upstream.enqueue(Reply(content="Two lines.\r\nAs asked."))
    reply, _ = await chat(client, [user("Line one.\r\nLine two.")])
    history = [user("Line one.\nLine two."), assistant(reply.replace("\r\n", "\n")), user("Thanks.")]
    _, headers = await chat(client, history)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert stored(config) == [user("Line one.\r\nLine two."), assistant(reply), user("Thanks."), assistant("reply 2")]
    assert upstream.last().messages == stored(config)[:3]  # the stored forms, each once
    assert_chain_consistent(config)


async def test_the_clients_own_version_of_the_first_answer_is_an_edit_of_it(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A resent history that leaves the stored one at the first answer: the assistant message there
    proves it is the history, the client's version of it (its UI reformatted the answer)."""
    client = proxy.client()
    upstream.enqueue(Reply(content="**Paris.**"))
    await chat(client, [user("capital of France?")])
    history = [user("capital of France?"), assistant("Paris."), user("and of Italy?")]
    reply, headers = await chat(client, history)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("edit", "1")
    assert upstream.last().messages == history
    assert stored(config) == [*history, assistant(reply)]
    assert stored(config, active=0) == [assistant("**Paris.**")]
    assert_chain_consistent(config)


# --- ambiguity keeps the memory ---------------------------------------------------------------------


async def test_a_new_message_equal_to_the_first_one_is_appended(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A prefix match without an assistant message in it proves no resent history: "continue" sent
    again by a new-messages client is a new message, not a regenerate of the first answer."""
    client = proxy.client()
    reply1, _ = await chat(client, [user("continue")])
    reply2, _ = await chat(client, [user("more")])
    reply3, headers = await chat(client, [user("continue")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert headers["X-Memproxy-Superseded"] == "0"
    assert stored(config, active=0) == []
    assert stored(config) == [user("continue"), assistant(reply1), user("more"), assistant(reply2),
                              user("continue"), assistant(reply3)]
    # Said by the client, the same request is a regenerate of the first answer.
    reply4, headers = await chat(proxy.client(**{"X-Memproxy-History": "full"}), [user("continue")])
    assert headers["X-Memproxy-Reconcile"] == "regenerate"
    assert headers["X-Memproxy-Superseded"] == "5"
    assert stored(config) == [user("continue"), assistant(reply4)]
    assert_chain_consistent(config)


async def test_an_echo_that_could_also_be_an_edit_keeps_the_memory(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """History [q, ok, q, ok]: [q, ok, x] is a resent tail then x, or an edit at position 2. The
    reading that forgets nothing wins."""
    client = proxy.client()
    upstream.enqueue(Reply(content="ok"), Reply(content="ok"))
    await chat(client, [user("q")])
    await chat(client, [user("q")])
    assert stored(config) == [user("q"), assistant("ok"), user("q"), assistant("ok")]
    reply, headers = await chat(client, [user("q"), assistant("ok"), user("x")])
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert stored(config) == [user("q"), assistant("ok"), user("q"), assistant("ok"), user("x"), assistant(reply)]
    assert_chain_consistent(config)


@pytest.mark.parametrize("history", ["auto", "new"])
async def test_a_turn_resent_without_the_calls_its_results_answer_continues_them(
    proxy: Proxy, upstream: FakeUpstream, config: Config, history: str
) -> None:
    """The Vercel AI SDK on a Responses `conversation`: its second step resends the turn's user
    message and then the tool result, leaving out the call it answers (the server holds it). A
    result can follow nothing but its call, so the user message is an echo, not a new one."""
    client = proxy.client(**{"X-Memproxy-History": history})
    upstream.enqueue(Reply(content="Hi."), Reply(tool_calls=[call("call_1", "Paris"), call("call_2", "Lima")]))
    await chat(client, [user("hello")], tools=TOOLS)
    await chat(client, [user("weather in Paris and Lima?")], tools=TOOLS)
    reply, headers = await chat(client, [user("weather in Paris and Lima?"), result("call_1", "18C"),
                                         result("call_2", "25C")], tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "window" and headers["X-Memproxy-Superseded"] == "0"
    calls = calls_message(call("call_1", "Paris"), call("call_2", "Lima"))
    history = [user("hello"), assistant("Hi."), user("weather in Paris and Lima?"), calls,
               result("call_1", "18C"), result("call_2", "25C")]
    sent_calls = {k: v for k, v in calls.items() if v is not None}  # an empty content goes as none
    assert upstream.last().messages == [*history[:3], sent_calls, *history[4:]]
    assert stored(config) == [*history, assistant(reply)]
    assert_chain_consistent(config)


async def test_a_turn_resent_without_its_calls_then_a_user_message_continues_them(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """instructor retrying a structured answer on the Responses API: its input again, then the
    validation error as a user message, without the call that failed validation. The input is an
    echo, not a second copy of the turn; the call stays stored (sent as text: it has no result)."""
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]), Reply(content="Fixed."))
    await chat(client, [user("weather in Paris?")], tools=TOOLS)
    reply, headers = await chat(client, [user("weather in Paris?"), user("Validation error: fix the city.")],
                                tools=TOOLS)
    assert headers["X-Memproxy-Reconcile"] == "window" and headers["X-Memproxy-Superseded"] == "0"
    assert [m for m in upstream.last().messages if m.get("role") == "user"] == [
        user("weather in Paris?"), user("Validation error: fix the city.")]
    assert stored(config) == [user("weather in Paris?"), calls_message(call("call_1", "Paris")),
                              user("Validation error: fix the city."), assistant(reply)]
    assert_chain_consistent(config)


async def test_later_steps_resent_without_the_assistants_messages_continue_them(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The same clients a step or a retry later: the Vercel AI SDK's third step sends the turn's
    user message and every result so far, none of the calls; instructor's second retry sends the
    input and both validation errors; a full-history client leaves out only the call it answers."""
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]), Reply(content="Paris is mild.", tool_calls=[
        call("call_2", "Lima")]), Reply(content="Both done."))
    await chat(client, [user("weather in Paris, then Lima?")], tools=TOOLS)
    await chat(client, [user("weather in Paris, then Lima?"), result("call_1", "18C")], tools=TOOLS)
    reply, headers = await chat(client, [user("weather in Paris, then Lima?"), result("call_1", "18C"),
                                         result("call_2", "25C")], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    turn = [user("weather in Paris, then Lima?"), calls_message(call("call_1", "Paris")), result("call_1", "18C"),
            {"role": "assistant", "content": "Paris is mild.", "tool_calls": [call("call_2", "Lima")]},
            result("call_2", "25C"), assistant(reply)]
    assert stored(config) == turn

    upstream.enqueue(Reply(tool_calls=[call("call_3", "Oslo")]), Reply(tool_calls=[call("call_4", "Oslo")]),
                     Reply(content="Oslo: cold."))
    await chat(client, [user("and Oslo?")], tools=TOOLS)
    await chat(client, [user("and Oslo?"), user("Validation error 1.")], tools=TOOLS)
    reply, headers = await chat(client, [user("and Oslo?"), user("Validation error 1."), user("Validation error 2.")],
                                tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    retries = [user("and Oslo?"), calls_message(call("call_3", "Oslo")), user("Validation error 1."),
               calls_message(call("call_4", "Oslo")), user("Validation error 2."), assistant(reply)]
    assert stored(config) == [*turn, *retries]

    upstream.enqueue(Reply(tool_calls=[call("call_5", "Rome")]), Reply(content="Rome: warm."))
    history = [*turn, *retries, user("and Rome?")]
    await chat(client, history, tools=TOOLS)
    reply, headers = await chat(client, [*history, result("call_5", "30C")], tools=TOOLS)  # the call left out
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert stored(config)[-3:] == [calls_message(call("call_5", "Rome")), result("call_5", "30C"), assistant(reply)]
    assert_no_duplicates(stored(config, active=None))
    assert_chain_consistent(config)


async def test_a_message_before_a_result_that_is_not_the_stored_turn_is_refused(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Only an exact echo of what precedes the calls reads so: another message before a result
    still puts the result after something other than its call, which no provider accepts."""
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    await chat(client, [user("weather in Paris?")], tools=TOOLS)
    with pytest.raises(openai.BadRequestError):
        await chat(client, [user("weather in Lima?"), result("call_1", "18C")], tools=TOOLS)
    assert stored(config) == [user("weather in Paris?"), calls_message(call("call_1", "Paris"))]


# --- superseding is visible ---------------------------------------------------------------------------


async def test_superseding_is_in_a_header_and_one_log_line_without_content(
    proxy: Proxy, upstream: FakeUpstream, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.chat")
    client = proxy.client()
    history = [user("secret question one")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("secret question two"))
    history.append(assistant((await chat(client, history))[0]))
    assert not [r for r in caplog.records if "supersede" in r.getMessage()]

    reply, headers = await chat(client, [*history[:2], user("secret question two, edited")])
    assert headers["X-Memproxy-Reconcile"] == "edit"
    assert headers["X-Memproxy-Superseded"] == "2"
    lines = [r.getMessage() for r in caplog.records if "supersede" in r.getMessage()]
    assert lines == [f"supersede session={session_digest('a', 's1')} kind=edit superseded=2 positions=2..3"
                     " (once the turn is recorded)"]
    assert all("secret" not in r.getMessage() and "s1 " not in r.getMessage() for r in caplog.records)
    assert stored(config, active=0) == history[2:]


async def test_a_system_prompt_alone_forgets_nothing_even_said_full(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client(**{"X-Memproxy-History": "full"})
    history = [user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    system = {"role": "system", "content": "be brief"}
    reply, headers = await chat(client, [system])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("append", "0")
    assert upstream.last().messages == [system, *history]
    assert stored(config) == [*history, assistant(reply)] and stored(config, active=0) == []


async def test_a_stale_full_history_client_forks_visibly(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The one fork mixing styles can cause (README, Client patterns): a full-history client resends
    its own, older history (lacking a script's turn) and a new message. Its history shows a stored
    prefix with an answer, then a divergence: an edit, reported, the script's turn kept apart."""
    ui, script = proxy.client(), proxy.client(**{"X-Memproxy-History": "new"})
    history = [user("from the UI")]
    history.append(assistant((await chat(ui, history))[0]))
    script_reply, _ = await chat(script, [user("from the script")])
    reply, headers = await chat(ui, [*history, user("from the UI again")])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("edit", "2")
    assert stored(config) == [*history, user("from the UI again"), assistant(reply)]
    assert stored(config, active=0) == [user("from the script"), assistant(script_reply)]


async def test_a_full_history_client_between_another_clients_turns_is_stored_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A script starts the session; a chat UI that resends its whole conversation joins it, and the
    two take turns. The UI's history matches neither the session's start nor its tail (the script's
    turns lie between its exchanges), but it is all stored, in order: only its new message is new.
    Appended whole, it was stored and sent again on every turn, growing as the square."""
    ui, script = proxy.client(), proxy.client(**{"X-Memproxy-History": "new"})
    await chat(script, [user("script: hello")])
    history: list[Message] = []
    kinds = []
    for turn in range(3):
        history.append(user(f"ui question {turn}"))
        reply, headers = await chat(ui, history)
        history.append(assistant(reply))
        kinds.append(headers["X-Memproxy-Reconcile"])
        await chat(script, [user(f"script: note {turn}")])
    assert kinds == ["append", "window", "window"]
    assert_no_duplicates(stored(config))
    assert len(stored(config)) == 2 + 3 * 4  # the script's first turn, then three of each
    sent = upstream.chat_requests()[-2].messages  # the UI's last request, as it went upstream
    assert_no_duplicates(sent)
    assert sent[-1] == user("ui question 2") and user("ui question 0") in sent and user("script: note 1") in sent


async def test_a_full_history_client_between_another_clients_turns_that_edits_keeps_everything_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The UI of the test above edits one of its own questions. Its messages between the script's
    cannot be told superseded, so they stay; what it sends from the edit on is appended, once, and
    the turns after that read as before: nothing lost, nothing stored twice but the answer the
    client resent after its edit."""
    ui, script = proxy.client(), proxy.client(**{"X-Memproxy-History": "new"})
    await chat(script, [user("script: hello")])
    history: list[Message] = []
    for turn in range(3):
        history.append(user(f"ui question {turn}"))
        history.append(assistant((await chat(ui, history))[0]))
        await chat(script, [user(f"script: note {turn}")])
    before = stored(config)
    history[2] = user("ui question 1, edited")
    edited = [*history, user("ui question 3")]
    reply, headers = await chat(ui, edited)
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert stored(config) == [*before, *edited[2:], assistant(reply)]  # everything kept, appended once
    history = [*edited, assistant(reply), user("ui question 4")]
    reply, headers = await chat(ui, history)
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert stored(config)[-2:] == [user("ui question 4"), assistant(reply)]
    assert len(stored(config)) == len(before) + len(edited) - 2 + 3


def signed(path: str, turn: int) -> str:
    """A presigned S3 URL for one object, as a client signs it afresh for each request."""
    return (f"https://bucket.s3.amazonaws.com/{path}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date=2026010{turn}T000000Z"
            f"&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature={turn:064x}&versionId=3")


def picture(url: str, detail: str = "auto") -> Message:
    return user([{"type": "text", "text": "What breed is this cat?"},
                 {"type": "image_url", "image_url": {"url": url, "detail": detail}}])


async def test_a_full_history_client_that_signs_its_image_urls_for_each_request_continues(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A chat app keeping uploads in object storage puts a freshly signed URL for the same image in
    every request, or asks for another `detail`: the same message, resent. Read as an edit or
    appended, the whole history was stored and sent again every turn."""
    client = proxy.client()
    history: list[Message] = []
    kinds = []
    for turn in range(4):
        first = picture(signed("uploads/cat.jpg", turn), "high" if turn % 2 else "low")
        messages = [first, *history[1:], user(f"question {turn}")] if history else [first]
        reply, headers = await chat(client, messages)
        kinds.append(headers["X-Memproxy-Reconcile"])
        history = [*messages, assistant(reply)]
    assert kinds == ["new", "continue", "continue", "continue"]
    assert len(stored(config)) == len(history) and stored(config)[0] == picture(signed("uploads/cat.jpg", 0), "low")
    assert_no_duplicates(stored(config))
    # Another object is another message: not the stored one (a first message edited without an
    # answer before it proves nothing, so it is appended: nothing is lost).
    other = picture(signed("uploads/dog.jpg", 9))
    _, headers = await chat(client, [other, *history[1:], user("and this one?")])
    assert headers["X-Memproxy-Reconcile"] == "append" and other in stored(config)


def with_context(question: str, source: str = "file text") -> Message:
    """A question as Open WebUI sends it with a file or knowledge attached: the retrieved text added
    to the newest user message alone (its own history keeps the question plain)."""
    return user(f"### Context:\n<source id=\"1\">{source}</source>\n\n### Query:\n{question}")


@pytest.mark.parametrize("newest", [None, 4])
async def test_a_client_naming_the_newest_message_alone_stores_each_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config, newest: int | None
) -> None:
    """A client that sends the speaker's `name` with the newest message and resends its history
    without it (whole, or its newest four messages): the history matched nothing stored, and was
    appended again, every exchange stored and sent twice. The stored forms, named, stay."""
    client = proxy.client()
    history: list[Message] = []
    named: list[Message] = []
    for n in range(4):
        question = user(f"q{n}")
        reply, headers = await chat(client, [*(history[-newest:] if newest else history), {**question, "name": "ada"}])
        history += [question, assistant(reply)]
        named += [{**question, "name": "ada"}, assistant(reply)]
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == (
        ("window" if newest else "continue"), "0")
    assert stored(config) == named and stored(config, active=0) == []
    assert upstream.last().messages == named[:-1]
    assert_chain_consistent(config)


@pytest.mark.parametrize("every_turn", [True, False])
async def test_a_ui_that_adds_context_to_the_newest_question_alone_continues(
    proxy: Proxy, upstream: FakeUpstream, config: Config, every_turn: bool
) -> None:
    """Open WebUI's default: retrieved context (or an attached file's text) goes into the newest user
    message only, and its history resends the plain question. The stored answer after it, unchanged,
    says it is the stored exchange: read as new, every exchange was stored and sent twice (plain and
    with its context). The stored forms stay: they hold all the client sent."""
    client = proxy.client()
    history: list[Message] = []
    kinds = []
    for turn, question in enumerate(["What does the PDF say?", "Summarise section 2.", "Thanks"]):
        sent = with_context(question) if every_turn or turn == 0 else user(question)
        reply, headers = await chat(client, [*history, sent])
        kinds.append((headers["X-Memproxy-Reconcile"], headers.get("X-Memproxy-Superseded", "0")))
        history += [user(question), assistant(reply)]
    assert kinds == [("new", "0"), ("continue", "0"), ("continue", "0")]
    questions = [with_context(q) if every_turn or turn == 0 else user(q)
                 for turn, q in enumerate(["What does the PDF say?", "Summarise section 2.", "Thanks"])]
    assert [m for m in stored(config) if m["role"] == "user"] == questions
    assert len(stored(config)) == 6 and stored(config, active=0) == []
    sent_upstream = [m for m in upstream.last().messages if m["role"] != "system"]
    assert sent_upstream == stored(config)[:5]
    assert_chain_consistent(config)


async def test_a_ui_that_adds_context_and_trims_its_history_stores_each_exchange_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The same UI sending only its newest four messages: its plain questions matched no echoed
    tail, and from the first trimmed turn on each exchange was stored and sent again (the whole
    window at first, then the last exchange at every turn)."""
    client = proxy.client()
    history: list[Message] = []
    questions = [f"What does page {n} say?" for n in range(5)]
    for question in questions:
        reply, headers = await chat(client, [*history[-4:], with_context(question)])
        history += [user(question), assistant(reply)]
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    kept = [m for q, a in zip(questions, history[1::2]) for m in (with_context(q), a)]
    assert stored(config) == kept and stored(config, active=0) == []
    assert [m for m in upstream.last().messages if m["role"] != "system"] == kept[:-1]
    assert_chain_consistent(config)


async def test_a_question_resent_with_something_added_is_not_taken_for_the_stored_one(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Only a question resent with less in it is the stored one: one that says something the stored
    question did not is the client's own, and is kept (appended, where nothing proves an edit)."""
    client = proxy.client()
    reply, _ = await chat(client, [user("What does the PDF say?")])
    _, headers = await chat(client, [with_context("What does the PDF say?"), assistant(reply), user("More?")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert with_context("What does the PDF say?") in stored(config)
    assert stored(config, active=0) == []


async def test_a_client_that_drops_the_middle_of_its_history_forgets_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client that keeps its first exchange and the newest ones, dropping the middle to fit its own
    budget (Cline), resends a stored prefix and then the stored tail. Read as an edit where they
    meet, the middle was superseded: forgotten. It is a window: nothing superseded, only the new
    message stored, and the whole history goes upstream."""
    client = proxy.client()
    history: list[Message] = []
    for turn in range(4):
        history.append(user(f"step {turn}"))
        history.append(assistant((await chat(client, history))[0]))
    trimmed = [*history[:2], *history[-4:], user("step 4")]
    reply, headers = await chat(client, trimmed)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert stored(config) == [*history, user("step 4"), assistant(reply)]
    assert [m for m in upstream.last().messages if m["role"] != "system"] == [*history, user("step 4")]


async def told(client: Any, turns: int) -> list[Message]:
    """A full-history client's conversation of `turns` exchanges ("step N", "reply N")."""
    history: list[Message] = []
    for turn in range(turns):
        history.append(user(f"step {turn}"))
        history.append(assistant((await chat(client, history))[0]))
    return history


CLINE_NOTICE = ("[NOTE] Some previous conversation history with the user has been removed to maintain optimal "
                "context window length.")


async def test_a_client_that_drops_the_middle_and_rewrites_the_first_answer_forgets_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Cline, truncating, also replaces the first answer's text with a notice that history was
    removed: its version of a stored message, then the gap, then the stored tail. A window: the
    stored forms stay (the real first answer, the middle), nothing is superseded."""
    client = proxy.client()
    history = await told(client, 5)
    reply, headers = await chat(client, [history[0], assistant(CLINE_NOTICE), *history[-4:], user("step 5")])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert stored(config) == [*history, user("step 5"), assistant(reply)]
    assert [m for m in upstream.last().messages if m["role"] != "system"] == [*history, user("step 5")]


async def test_a_dropped_middle_before_tool_results_forgets_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The same dropped middle on a turn that brings tool results: the tail ends at the stored call
    (the head), not at a user message."""
    client = proxy.client()
    history = await told(client, 4)
    history.append(user("run it"))
    upstream.enqueue(Reply(tool_calls=[call("c1", "Oslo")]))
    await chat(client, history, tools=TOOLS)
    history.append(calls_message(call("c1", "Oslo")))
    reply, headers = await chat(client, [*history[:2], *history[-5:], result("c1", "ok")], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert stored(config) == [*history, result("c1", "ok"), assistant(reply)]


async def _tool_turn(client: openai.AsyncOpenAI, upstream: FakeUpstream, resent: list[Message], question: str,
                     calls: list[dict[str, Any]], text: str | None = None) -> tuple[list[Message], Message]:
    """One turn of a chat UI that keeps only the text of its turns: it resends `resent` (its texts),
    then the question, and in the turn's tool loop the calls and results so far, one call a step.
    The turn as stored, and the answer as the UI keeps it."""
    turn = [user(question)]
    for made in calls:
        upstream.enqueue(Reply(content=text, tool_calls=[made]))
        await chat(client, [*resent, *turn], tools=TOOLS)
        turn += [{"role": "assistant", "content": text, "tool_calls": [made]}, result(made["id"], f"r {made['id']}")]
    reply, headers = await chat(client, [*resent, *turn], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) in (
        ("new", "0"), ("continue", "0"), ("window", "0")), headers
    return [*turn, assistant(reply)], assistant(reply)


async def test_a_history_resent_without_its_tool_calls_and_results_forgets_none(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A chat UI that resends only the text of earlier turns (their questions and answers), the
    current turn's calls and results alone: at the third turn's first call the calls it left out
    were more than `_resent_among` looks back over, and the request read as an edit at the first
    call, superseding every result since (never sent again)."""
    client = proxy.client()
    history: list[Message] = []
    texts: list[Message] = []
    for n in range(3):
        turn, answer = await _tool_turn(client, upstream, texts, f"q{n}",
                                        [call(f"c{n}{k}", f"city {k}") for k in range(5)])
        history += turn
        texts += [turn[0], answer]
    assert stored(config) == history and stored(config, active=0) == []
    reply, headers = await chat(client, [*texts, user("q3")], tools=TOOLS)
    assert [loose_json(m) for m in upstream.last().messages] == [loose_json(m) for m in [*history, user("q3")]]
    assert stored(config) == [*history, user("q3"), assistant(reply)]
    assert_chain_consistent(config)


async def test_a_trimmed_history_without_its_tool_calls_is_stored_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """That UI resending only its newest four texts, the turns behind them making five calls each:
    at the fourth turn's first result its window matched no echoed tail (the calls it left out
    are stored between its messages) and lay further back than `_resent_among` reads, and was
    appended whole: its questions and answers stored twice, the call stored again before its
    result."""
    client = proxy.client()
    history: list[Message] = []
    texts: list[Message] = []
    for n in range(4):
        turn, answer = await _tool_turn(client, upstream, texts[-4:], f"q{n}",
                                        [call(f"c{n}{k}", f"city {k}") for k in range(5)])
        history += turn
        texts += [turn[0], answer]
    assert stored(config) == history and stored(config, active=0) == []
    reply, headers = await chat(client, [*texts[-4:], user("q4")], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert stored(config) == [*history, user("q4"), assistant(reply)]
    assert_chain_consistent(config)


async def test_a_history_resent_without_its_tool_calls_regenerates_the_last_answer_alone(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The same UI regenerating its last answer: its texts up to the last question. Read as an edit
    at the first call, every result was superseded; it regenerates the last turn, its calls too."""
    client = proxy.client()
    history: list[Message] = []
    texts: list[Message] = []
    for n in range(2):
        turn, answer = await _tool_turn(client, upstream, texts, f"q{n}", [call(f"c{n}", f"city {n}")])
        history += turn
        texts += [turn[0], answer]
    reply, headers = await chat(client, texts[:-1], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("regenerate", "3")
    kept = history[:-3]  # the last turn's call, its result and its answer superseded
    assert [loose_json(m) for m in upstream.last().messages] == [loose_json(m) for m in kept]
    assert stored(config) == [*kept, assistant(reply)] and stored(config, active=0) == history[-3:]
    assert_chain_consistent(config)


async def test_an_answer_resent_without_its_calls_is_the_stored_one(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """An answer that said something and called a tool, resent as its text alone (its call and
    result left out): read as the client's version of it, an edit, the result went."""
    client = proxy.client()
    turn, answer = await _tool_turn(client, upstream, [], "q0", [call("c1", "Oslo")], text="Let me check.")
    texts = [turn[0], {"role": "assistant", "content": "Let me check."}, answer]
    reply, headers = await chat(client, [*texts, user("q1")], tools=TOOLS)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("window", "0")
    assert [loose_json(m) for m in upstream.last().messages] == [loose_json(m) for m in [*turn, user("q1")]]
    assert stored(config) == [*turn, user("q1"), assistant(reply)] and stored(config, active=0) == []


async def test_a_trimmed_history_with_its_own_copy_of_the_last_answer_stores_it_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client that sends its newest four messages and keeps its own copy of each answer (its
    markdown normalised): its copy of the last answer was stored after the stored one, and both
    were sent from then on; now it is that answer's edit, as it is for a client resending the whole
    history."""
    client = proxy.client()
    history: list[Message] = []
    for n in range(4):
        upstream.enqueue(Reply(content=f"**answer {n}**"))
        _, headers = await chat(client, [*history[-4:], user(f"q{n}")])
        history += [user(f"q{n}"), assistant(f"answer {n}")]
    assert headers["X-Memproxy-Reconcile"] == "edit" and headers["X-Memproxy-Superseded"] == "1"
    assert upstream.last().messages == [*history[:-1]]
    assert stored(config) == [*history[:-1], assistant("**answer 3**")]
    assert stored(config, active=0) == [assistant(f"**answer {n}**") for n in range(3)]
    assert_chain_consistent(config)


async def test_a_trimmed_history_up_to_the_last_question_regenerates_its_answer(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client sending its newest messages asks for the last answer again (regenerate, or a retry
    of a turn whose answer it never got): it read as a new question after the stale answer, the
    question stored twice and both sent. A new-messages client repeating its last question
    ("continue") still appends: it sends no answer."""
    client = proxy.client()
    history: list[Message] = []
    for n in range(4):
        reply, _ = await chat(client, [*history[-4:], user(f"q{n}")])
        history += [user(f"q{n}"), assistant(reply)]
    reply, headers = await chat(client, history[-5:-1])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("regenerate", "1")
    assert upstream.last().messages == history[:-1]
    assert stored(config) == [*history[:-1], assistant(reply)] and stored(config, active=0) == history[-1:]
    _, headers = await chat(client, [user("q3")])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("append", "0")
    assert_chain_consistent(config)


async def test_an_answer_edited_with_everything_after_it_resent_is_an_edit(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The client's version of an earlier answer, then the rest of the stored history: no gap, so no
    dropped middle; its version is an edit there, as for the first answer alone."""
    client = proxy.client()
    history = await told(client, 2)
    edited = [history[0], assistant("my own version"), *history[2:], user("step 2")]
    reply, headers = await chat(client, edited)
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("edit", "3")
    assert stored(config) == [*edited, assistant(reply)]


async def test_a_regenerate_after_a_repeated_exchange_is_a_regenerate(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A history that stops before the last answer, whose last messages happen to equal the newest
    stored ones (the same question asked twice, answered the same): a regenerate, not a dropped
    middle (the tail must follow the matched prefix, after a gap)."""
    client = proxy.client()
    history: list[Message] = []
    for question, answer in [("Start", "Ready."), ("Next", "OK."), ("Is it safe?", "Yes."), ("Next", "OK.")]:
        upstream.enqueue(Reply(content=answer))
        history.append(user(question))
        await chat(client, history)
        history.append(assistant(answer))
    upstream.enqueue(Reply(content="Yes, it is."))
    _, headers = await chat(client, history[:5])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("regenerate", "3")
    assert [m for m in upstream.last().messages if m["role"] != "system"] == history[:5]


async def test_a_client_of_new_messages_with_its_own_example_answer_supersedes_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client that sends only its new turn, behind its instructions and a few-shot example of its
    own (an assistant message stored nowhere, picked per request): its answer proves no resent
    history. Appended each time, nothing superseded."""
    client = proxy.client()
    instructions = user("Classify the sentiment of the text. Answer with one word.")
    for i, (text, label) in enumerate([("I love it", "positive"), ("It broke", "negative"), ("Meh", "neutral")]):
        _, headers = await chat(client, [instructions, user(f"Example: {text}"), assistant(label),
                                         user(f"Text {i}: great day")])
        assert headers["X-Memproxy-Superseded"] == "0"
    assert stored(config, active=0) == []


async def test_a_trimmed_history_with_a_note_where_the_middle_was_keeps_the_middle(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """A client that keeps its first message and the newest ones and marks the gap with a note of its
    own: nothing proves an edit at the note (the stored answers after it are the tail, not what
    follows the note in the store), so nothing is superseded."""
    client = proxy.client()
    history = await told(client, 5)
    note = {"role": "system", "content": "[earlier messages omitted]"}
    _, headers = await chat(client, [history[0], note, *history[-4:], user("step 5")])
    assert headers["X-Memproxy-Superseded"] == "0"
    assert all(m in stored(config) for m in history)


async def test_a_note_put_into_the_history_is_sent_where_the_client_put_it_and_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """SillyTavern's author's note: a system message a few messages from the end of every request.
    Its history with the note in it is the client's version of the stored one (an edit where they
    part), sent as the client wrote it; appended, the whole history went upstream twice."""
    client = proxy.client()
    history: list[Message] = []
    note = {"role": "system", "content": "[Author's note: write two paragraphs]"}
    for turn in range(4):
        history.append(user(f"line {turn}"))
        messages = [*history[:-4], note, *history[-4:]] if len(history) > 4 else list(history)
        reply, headers = await chat(client, messages)
        sent = [m for m in upstream.last().messages]
        assert sent == messages
        assert_no_duplicates(stored(config))
        history.append(assistant(reply))
    assert stored(config)[-1] == history[-1]


@pytest.mark.parametrize("content", [[{"type": "refusal", "refusal": "I cannot help with that."}],
                                     "I cannot help with that.", [{"type": "text", "text": "I cannot help with that."}]],
                         ids=["refusal-part", "text", "text-part"])
async def test_a_refusal_echoed_as_a_content_part_or_as_text_is_the_stored_refusal(
    content: Any, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """The openai SDK echoes a refusal as a `refusal` part; the Vercel AI SDK makes it the answer's
    text, which it resends as such. Either is the stored refusal, not an edit of it."""
    client = proxy.client()
    upstream.enqueue(Reply(refusal="I cannot help with that."))
    await complete(client, [user("how to pick locks")])
    echoed = {"role": "assistant", "content": content}
    _, headers = await chat(client, [user("how to pick locks"), echoed, user("a joke, then")])
    assert (headers["X-Memproxy-Reconcile"], headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert len(stored(config)) == 4
    assert stored(config)[1]["refusal"] == "I cannot help with that."
    assert not loosely_equal({"role": "assistant", "content": "", "refusal": "No."}, assistant("Yes."))


@pytest.mark.parametrize("history", ["auto", "new"])
async def test_a_refusal_echoed_without_it_before_a_new_question_is_the_stored_refusal(
    history: str, proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """LangChain's `ChatOpenAI` resends a refused answer as `{"role": "assistant", "content": ""}`
    (it keeps the refusal in `additional_kwargs`, which it never sends). A client that sends only its
    newest messages, the answer it got among them, echoes the stored refusal so: the same message by
    its hash, as a whole resent history finds. Read as a new message, the empty answer was stored
    after the refusal and sent on every turn (a provider such as Anthropic refuses empty content)."""
    client = proxy.client(**{"X-Memproxy-History": history})
    upstream.enqueue(Reply(refusal="I cannot help with that."))
    await complete(client, [user("how to pick locks")])
    _, headers = await chat(client, [{"role": "assistant", "content": ""}, user("a joke, then")])
    assert headers["X-Memproxy-Reconcile"] == "window"
    assert upstream.last().messages == [user("how to pick locks"),
                                        {"role": "assistant", "refusal": "I cannot help with that.", "content": ""},
                                        user("a joke, then")]
    assert [m["role"] for m in stored(config)] == ["user", "assistant", "user", "assistant"]
    assert stored(config)[1]["refusal"] == "I cannot help with that."
    assert loosely_equal({"role": "assistant", "content": None, "refusal": "No."},
                         {"role": "assistant", "content": ""})
    assert not loosely_equal({"role": "assistant", "content": None, "refusal": "No."},
                             {"role": "assistant", "content": "Yes."})


def test_loose_equality_reads_arguments_as_json_and_leaves_hashes_alone() -> None:
    spelt = [calls_message(call("call_1", "Paris", spacing)) for spacing in ((",", ":"), (", ", ": "))]
    assert loosely_equal(*spelt)
    assert chain_hash(ROOT_HASH, spelt[0]) != chain_hash(ROOT_HASH, spelt[1])  # stored hashes stay valid
    assert not loosely_equal(spelt[0], calls_message(call("call_1", "Oslo")))
    unparsable = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}]} for text in ("{a", "{a ")]
    assert not loosely_equal(*unparsable)  # text that is not JSON compares as it is spelt
    assert loosely_equal({"role": "assistant", "content": "", "refusal": None, "annotations": []},
                         {"role": "assistant", "content": None})
    assert not loosely_equal(user("hi"), assistant("hi"))


async def test_a_call_resent_with_arguments_nested_past_the_stack_is_compared_as_spelt(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Arguments are read as JSON to compare a resent call with the stored one; arguments nested
    deeper than Python's stack made `json.loads` raise RecursionError, answered 500 (a chat and a
    preview alike). Text too deep to read compares as it is spelt, as text that is not JSON does."""
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=[call("call_1", "Paris")]))
    await chat(client, [user("weather in Paris?")], tools=TOOLS, model="big")
    deep = "[" * 5000 + "]" * 5000
    resent = calls_message({**call("call_1", "Paris"), "function": {"name": "get_weather", "arguments": deep}})
    history = [user("weather in Paris?"), resent, result("call_1", "18C")]
    preview = await proxy.client(None).post("/sessions/s1/context", cast_to=httpx.Response,
                                            body={"model": "big", "messages": history, "tools": TOOLS})
    assert preview.status_code == 200, preview.text
    reply, _ = await chat(client, history, tools=TOOLS, model="big")
    # read as the stored call's result (a call differently spelt is no edit of a result-only resend)
    assert stored(config) == [user("weather in Paris?"), calls_message(call("call_1", "Paris")),
                              result("call_1", "18C"), assistant(reply)]


# --- what a resent history may and may not be read as ------------------------------------------


async def say(client: Any, upstream: FakeUpstream, history: list[Message], question: str, answer: str) -> None:
    upstream.enqueue(Reply(content=answer))
    history.append(user(question))
    await chat(client, history)
    history.append(assistant(answer))


async def test_an_edit_behind_a_repeated_exchange_is_not_a_dropped_middle(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """An answer edited in place (SillyTavern, LibreChat), the rest resent, where the newest exchange
    also happened earlier ("thanks" / "You're welcome!"): the earlier copy is no stored tail after a
    dropped middle (what follows it holds an answer), so the edit is sent, nothing stored twice."""
    client = proxy.client()
    history: list[Message] = []
    for q, a in [("q0", "a0"), ("thanks", "You're welcome!"), ("q2", "a2"), ("thanks", "You're welcome!")]:
        await say(client, upstream, history, q, a)
    edited = [history[0], assistant("a0, edited"), *history[2:], user("q3")]
    _, headers = await chat(client, edited)
    sent = [m for m in upstream.last().messages if m["role"] != "system"]
    assert headers["X-Memproxy-Reconcile"] == "edit", headers["X-Memproxy-Reconcile"]
    assert sent == edited, sent
    assert_no_duplicates(stored(config)[4:])


async def test_a_context_pair_moved_after_the_history_is_not_a_dropped_middle(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Aider's layout without a trailing reminder: a fixed opening exchange (repo map), the done
    messages, then the chat files (a user/assistant pair, the file's current text) moved after them,
    then the new message. The previous request's files pair is no dropped middle (an answer follows
    it in the client's messages): no stale copy of the file is kept, turn after turn."""
    client = proxy.client()
    repo = [user("Here are summaries of some files present in my git repository."),
            assistant("Ok, I won't try and edit those files without asking first.")]
    def files(v: int) -> list[Message]:
        return [user(f"I have *added these files to the chat*\nfoo.py\n```\nreturn {v}\n```"),
                assistant("Ok, any changes I propose will be to those files.")]
    done: list[Message] = []
    kinds = []
    for turn in range(3):
        q = user(f"make it return {turn + 1}")
        messages = [*repo, *done, *files(turn), q]
        upstream.enqueue(Reply(content=f"edit {turn}"))
        _, headers = await chat(client, messages)
        kinds.append(headers["X-Memproxy-Reconcile"])
        sent = [m for m in upstream.last().messages if m["role"] != "system"]
        stale = [m for m in sent if "```" in (m.get("content") or "")]
        assert len(stale) == 1, (kinds, [m["content"][-14:] for m in stale])
        done += [q, assistant(f"edit {turn}")]


async def test_a_question_shortened_in_place_is_sent_as_shortened(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Open WebUI's "Save" (not "Send") on an edited question keeps the answer after it: a user who
    removes a secret pasted by mistake. A question shortened within its lines is no question resent
    without its context: an edit, so the secret never goes upstream again."""
    client = proxy.client()
    history: list[Message] = []
    await say(client, upstream, history, "hi", "Hello!")
    await say(client, upstream, history, "Why does this fail? key=sk-SECRET123", "Because ...")
    await say(client, upstream, history, "thanks", "Welcome.")
    edited = [*history[:2], user("Why does this fail?"), *history[3:], user("more")]
    _, headers = await chat(client, edited)
    sent = [m for m in upstream.last().messages if m["role"] != "system"]
    assert not any("sk-SECRET" in (m.get("content") or "") for m in sent), (headers["X-Memproxy-Reconcile"], sent)
