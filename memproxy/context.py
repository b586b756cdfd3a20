"""Fitting a request into the model's window: the budget and the pre-flight overflow check.

budget = max input tokens - output reserve - safety margin. The request sent is the system prompt,
then the newest stored messages that fit, then the client's new messages. Stored history is dropped
oldest first in whole units (a message and the tool results that answer it), so no tool result is
ever sent without its call, nor a call without its results (a call the client never answered is left
out of what is sent). What must be sent (system, tools, new
messages, and the stored unit a new tool result answers) is checked first: if that alone cannot fit,
`ContextLengthExceeded` is raised before anything is sent or stored.

Stored messages carry their token counts and running totals, so finding the cut is one indexed
lookup: nothing stored is re-read or re-tokenized to build a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ContextLengthExceeded
from .messages import Message, starts_unit
from .store import SessionState, Store, StoredMessage
from .tokens import REPLY_PRIMING, TokenCounter


@dataclass(frozen=True)
class Budget:
    window: int
    output_reserve: int
    margin: int

    @property
    def input_tokens(self) -> int:
        return self.window - self.output_reserve - self.margin


@dataclass(frozen=True)
class Context:
    messages: list[Message]
    tokens: int  # counted tokens of the whole request
    included: int  # stored messages sent
    omitted: int  # stored messages left out
    base_cum: int  # tokens of the stored history kept before the new messages


async def build_context(
    store: Store,
    session: SessionState | None,
    base: int,
    system: list[Message],
    system_tokens: int,
    new: list[Message],
    new_tokens: int,
    tools_tokens: int,
    budget: Budget,
    model_name: str,
    counter: TokenCounter,
) -> Context:
    fixed = system_tokens + new_tokens + tools_tokens + REPLY_PRIMING
    available = budget.input_tokens - fixed
    if session is None or base == 0:
        _check_fits(available, 0, fixed, budget, model_name)
        return Context(system + new, fixed, 0, 0, 0)
    cum_base = await store.cum_at(session, base)
    must_start = base
    if not new or not starts_unit(new[0]):
        # The newest stored unit must go: it holds the call a new tool result answers, or, when the
        # client sent nothing new (regenerate), the message being answered.
        must_start = await store.last_unit_start(session, base)
    must_tokens = cum_base - await store.cum_at(session, must_start) if must_start < base else 0
    _check_fits(available, must_tokens, fixed, budget, model_name)
    start = await store.first_fitting_unit_start(session, 0, cum_base - available)
    if start is None or start > must_start:
        start = must_start
    stored = await store.active_range(session, start, base)
    stored_tokens = cum_base - stored[0].cum_before if stored else 0
    history, saved = drop_unanswered_calls(stored, new, counter)
    return Context(
        messages=system + history + new,
        tokens=fixed + stored_tokens - saved,
        included=len(history),
        omitted=base - len(history),
        base_cum=cum_base,
    )


def drop_unanswered_calls(
    stored: list[StoredMessage], new: list[Message], counter: TokenCounter
) -> tuple[list[Message], int]:
    """The stored messages to send, without tool calls that no tool result answers.

    A client may get tool calls back and move on without running them; providers refuse a request
    holding an unanswered call. Such calls are left out of what is sent (the store keeps them), and
    a message left with neither calls nor content is not sent. Returns the tokens this saved.
    """
    sequence = [m.body for m in stored] + new
    history: list[Message] = []
    saved = 0
    for i, message in enumerate(stored):
        calls = message.body.get("tool_calls")
        if not calls:
            history.append(message.body)
            continue
        answered = set()
        for following in sequence[i + 1 :]:
            if following.get("role") != "tool":
                break
            answered.add(following.get("tool_call_id"))
        kept = [call for call in calls if call.get("id") in answered]
        if len(kept) == len(calls):
            history.append(message.body)
            continue
        body = {k: v for k, v in message.body.items() if k != "tool_calls"}
        if kept:
            body["tool_calls"] = kept
        elif not body.get("content"):
            saved += message.tokens
            continue
        saved += message.tokens - counter.message(body)
        history.append(body)
    return history, saved


def _check_fits(available: int, must_tokens: int, fixed: int, budget: Budget, model: str) -> None:
    if must_tokens <= available:
        return
    raise ContextLengthExceeded(
        f"This request needs at least {fixed + must_tokens} input tokens (system prompt, tools and the "
        f"new messages), but model '{model}' allows {budget.input_tokens}: a context window of "
        f"{budget.window} minus {budget.output_reserve} reserved for the output and a safety margin of "
        f"{budget.margin}. Shorten the new messages or lower max_tokens.",
        param="messages",
    )
