"""How older messages are sent smaller, without touching what is stored.

The one head-and-tail truncator lives here (`head_and_tail`, and `fit_head_and_tail` over it when
the result must fit a token count): the compact form of a tool output and the summariser's
transcript both cut long texts through it.

- A tool result larger than `tool_output_max_tokens` is sent, once it is older than the newest
  exchange, as its head and tail around a marker giving the full size (its pictures and files, if it
  has any, whole). The compact form is computed once, when the message is stored, and its text is
  itself under the limit, so trimming again changes nothing.
- An assistant message's reasoning (`reasoning_content`, `reasoning`, `thinking_blocks`) is stored
  and shown but, once older than the newest exchange, not sent: its compact form is the message
  without it (`memproxy.messages.without_reasoning`), counted without it too.
- A large content repeated later (the same file read or pasted twice) is sent once: in the older part
  of a request, a later copy becomes a short reference to the earlier one, which is sent too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..config import MemoryConfig
from ..messages import Message, starts_unit, without_reasoning
from ..searchtext import recall_line
from ..store import NewMessage
from ..tokens import TokenCounter

_TRIM_MARKER = "\n[... {omitted} of {total} characters of this tool output left out here ...]\n"


def title_of(messages: Iterable[Message]) -> str | None:
    """A session's title: its first user prompt, cut to 100 characters (None: no prompt yet)."""
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            text = content_text(message) if not isinstance(content, list) else " ".join(
                str(p.get("text")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text and text.strip():  # a picture with a question: the question
                return text.strip()[:100]
    return None


def content_text(message: Message) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def head_and_tail(text: str, head: int, tail: int, marker: str) -> str:
    """`text` cut to its first `head` and last `tail` characters around `marker`, which may name
    how many characters were left out (`{omitted}`) of how many (`{total}`)."""
    omitted = len(text) - head - tail
    return text[:head] + marker.format(omitted=omitted, total=len(text)) + (text[len(text) - tail:] if tail else "")


def fit_head_and_tail(
    text: str, max_tokens: int, counter: TokenCounter, marker: str, shares: tuple[int, int, int],
    shrink: tuple[int, int],
) -> str:
    """The head and tail of `text` in at most `max_tokens`, counted, not estimated. The first guess
    keeps the share of characters the token limit allows, `shares` (head, tail, out of) of it from
    each end; each retry keeps `shrink` (a fraction) of the last guess, until it fits."""
    head_share, tail_share, whole = shares
    keep = len(text) * max_tokens // max(counter.text(text), 1)
    while True:
        cut = head_and_tail(text, keep * head_share // whole, keep * tail_share // whole, marker)
        if counter.text(cut) <= max_tokens or keep == 0:
            return cut
        keep = keep * shrink[0] // shrink[1]


def trimmed_tool_output(message: Message, max_tokens: int, counter: TokenCounter) -> Message | None:
    """The compact form of a tool result whose text is over `max_tokens`, or None if it is sent as
    it is. A result of text alone becomes one text. In one that also holds pictures or files (a
    screenshot beside a page's text), those are kept whole, where they were (media cannot be cut),
    and the text parts are cut in place to one cap: the largest one under which they fit the limit
    together, so a short part stays whole. Where that cap would leave a part too little to say what
    was cut (many long parts), the text parts are joined into the first one's place and cut as one."""
    if max_tokens <= 0 or message.get("role") not in ("tool", "function"):
        return None
    text = content_text(message)
    if text is not None:
        if counter.text(text) <= max_tokens:
            return None
        return {**message, "content": _cut(text, max_tokens, counter)}
    parts = message.get("content")
    if not isinstance(parts, list):
        return None
    sizes = {i: counter.text(p["text"]) for i, p in enumerate(parts)
             if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)}
    if sum(sizes.values()) <= max_tokens:
        return None
    cap, cut = _cap(sorted(sizes.values()), max_tokens), list(parts)
    if cap >= _LEAST_CUT_TOKENS:
        for i, size in sizes.items():
            if size > cap:
                cut[i] = {**parts[i], "text": _cut(parts[i]["text"], cap, counter)}
        return {**message, "content": cut}
    first, *rest = sizes
    joined = "".join(parts[i]["text"] for i in sizes)
    cut[first] = {**parts[first], "text": _cut(joined, max_tokens, counter)}
    return {**message, "content": [p for i, p in enumerate(cut) if i not in rest]}


_LEAST_CUT_TOKENS = 32  # a cut text part keeps at least this much: the marker alone takes about 20


def _cap(sizes: list[int], budget: int) -> int:
    """The largest cap such that `sizes` (ascending), each cut to it, sum to at most `budget`."""
    for k, size in enumerate(sizes):
        fair = budget // (len(sizes) - k)
        if size > fair:
            return fair
        budget -= size
    return budget


def _cut(text: str, max_tokens: int, counter: TokenCounter) -> str:
    return fit_head_and_tail(text, max_tokens, counter, _TRIM_MARKER, (2, 1, 3), (4, 5))


def new_message(body: Message, chain: str, counter: TokenCounter, memory: MemoryConfig) -> NewMessage:
    """A message as it will be stored: counted once, with its compact form if it has one."""
    compact = trimmed_tool_output(body, memory.tool_output_max_tokens, counter)
    if compact is None and (plain := without_reasoning(body)) is not body:
        compact = plain
    return NewMessage(
        body=body,
        tokens=counter.message(body),
        unit_start=starts_unit(body),
        chain_hash=chain,
        compact_body=compact,
        compact_tokens=None if compact is None else counter.message(compact),
        recall_tokens=counter.text(recall_line(compact if compact is not None else body)),
    )


def dedupe_repeats(
    messages: Sequence[Message], tokens: Sequence[int], min_tokens: int, counter: TokenCounter,
    seen: dict[str, int] | None = None, offset: int = 0,
) -> tuple[list[Message], int]:
    """Later copies of a large content replaced by a reference to the first; returns the tokens saved.
    `seen`: the contents met before `messages` (text -> position), which it adds to, the first of
    `messages` being at `offset` (the messages before it deduplicated already, as `memory.sent` does)."""
    out = list(messages)
    if min_tokens <= 0:
        return out, 0
    if seen is None:
        seen = {}
    saved = 0
    # Only large contents are looked at; most chat messages are not (a comprehension, not a loop).
    for index in [i for i, count in enumerate(tokens) if count >= min_tokens]:
        message, count = messages[index], tokens[index]
        text = content_text(message)
        if text is None or message.get("role") == "assistant":
            continue
        # Keyed by the text itself: a string caches its hash, and stored messages are the same
        # objects from turn to turn (the store's history cache), so each is hashed once, not per turn.
        if text not in seen:
            seen[text] = offset + index
            continue
        reference: dict[str, Any] = {
            **message,
            "content": f"[The same {len(text)} characters as an earlier message above; not repeated.]",
        }
        smaller = count - counter.message(reference)
        if smaller <= 0:  # a repeat shorter than its reference goes as it is: never grow a request
            continue
        saved += smaller
        out[index] = reference
    return out, saved
