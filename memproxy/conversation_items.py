"""The Conversations API's items, as plain functions over plain data: no I/O.

A conversation is a session (`memproxy.conversations`), and its items are the session's active
messages read as Responses items, the way `input_items` (`memproxy.responses_wire`) renders them:
a user, system or developer message as a `message` of `input_text` parts, a tool result as a
`function_call_output`, an assistant message as its output items (`output_items`: `reasoning`,
`message` of `output_text`, one `function_call` per tool call). One stored message is thus one
item or several, and an item is addressed by the message it comes from and its place among that
message's items.

Ids. An item that is the output of a response memproxy kept (`POST /v1/responses` with
`conversation`, or any kept turn of the session) has that response's id for it (`msg_<the
response's 24 hex digits>_<n>`), as long as its answer stands unedited. Every other item's id is
its kind's prefix, 32 hex digits of a digest of the tenant, the session and the message's chained
hash, and its place among its message's items (`msg_<32 hex>_0`): stable while the history up to
that message is, and never the same in another conversation. An edit before a message (a deleted
item) chains it anew, so items after a deleted one get new ids.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest
from .messages import REASONING_KEYS, Message
from .responses_wire import ITEM_PREFIXES, Item, input_items, listed_item, output_items
from .store import KeptAnswer, StoredMessage

MAX_NEW_ITEMS = 20  # items one create adds at most, as OpenAI's Conversations API takes
_METADATA_KEYS, _KEY_CHARS, _VALUE_CHARS = 16, 64, 512  # OpenAI's limits on `metadata`


def new_conversation_id() -> str:
    return f"conv_{secrets.token_hex(24)}"


@dataclass(frozen=True)
class ListedItem:
    """An item of a conversation, with the stored message it comes from."""

    seq: int  # the message's position in the session
    place: int  # the item's place among that message's items
    item: Item


def message_items(message: Message, custom_calls: Iterable[str] = ()) -> list[Item]:
    """A stored message as conversation items, without ids; `custom_calls`: the ids of the custom
    tools' calls before it, whose results are custom tool call outputs."""
    role = message.get("role")
    if role == "assistant":
        items = output_items(message, lambda prefix: "")
        for item in items:
            item.pop("id", None)
        return items
    [item] = input_items([message], custom_calls)
    return [{**listed_item(item), "status": "completed"}]


def conversation_items(tenant: str, session_id: str, messages: Sequence[StoredMessage],
                       kept: Sequence[KeptAnswer] = ()) -> list[ListedItem]:
    """Every item of the active messages, in order, each with its id (see the module's docstring)."""
    answers = {answer.seq: answer.output for answer in kept}
    listed: list[ListedItem] = []
    custom: set[str] = set()
    for message in messages:
        items = message_items(message.body, custom)
        custom.update(str(item.get("call_id")) for item in items if item.get("type") == "custom_tool_call")
        ids = _kept_ids(items, answers.get(message.seq)) or [
            item_id(tenant, session_id, message.chain_hash, item, place) for place, item in enumerate(items)]
        listed += [ListedItem(message.seq, place, {"id": ids[place], **item}) for place, item in enumerate(items)]
    return listed


def item_id(tenant: str, session_id: str, chain: str, item: Item, place: int) -> str:
    digest = hashlib.sha256("\x00".join((tenant, session_id, chain)).encode("utf-8", "surrogatepass")).hexdigest()
    return f"{ITEM_PREFIXES.get(item['type'], 'item')}_{digest[:32]}_{place}"


def _kept_ids(items: list[Item], output: list[Any] | None) -> list[str] | None:
    """A kept response's output item ids for the items of its answer, where they are the same items
    (same kinds, in the same order: a native provider's output may hold others)."""
    if output is None or len(output) != len(items):
        return None
    ids = [o.get("id") if isinstance(o, dict) and o.get("type") == item["type"] else None
           for o, item in zip(output, items)]
    return [i for i in ids if isinstance(i, str) and i] if all(isinstance(i, str) and i for i in ids) else None


def without_item(messages: Sequence[Message], at: int, place: int) -> tuple[int, list[Message]]:
    """The messages without the item at `place` of `messages[at]`: where the first one changed
    is, and what replaces the messages from there on. A function call goes with its output and an
    output with its call (a provider refuses either alone); an assistant message left with nothing
    to say (no text, refusal or call: its reasoning alone at most) goes whole."""
    kept: list[Message | None] = list(messages)
    message = messages[at]
    first = at
    if message.get("role") == "assistant":
        items = message_items(message)
        kind = items[place]["type"]
        changed: Message = dict(message)
        if kind == "reasoning":
            for key in REASONING_KEYS:
                changed.pop(key, None)
        elif kind == "message":
            changed["content"] = None
            changed.pop("refusal", None)
        else:  # its calls are its last items, in order
            call = changed["tool_calls"][place - (len(items) - len(changed["tool_calls"]))]
            changed["tool_calls"] = [c for c in changed["tool_calls"] if c is not call]
            for i in range(at + 1, len(kept)):
                later = kept[i]
                if later is not None and later.get("role") == "tool" and later.get("tool_call_id") == call.get("id"):
                    kept[i] = None
        kept[at] = _said(changed)
    else:
        kept[at] = None
        call_id = message.get("tool_call_id") if message.get("role") == "tool" else None
        for i in range(at - 1, -1, -1):  # the call it answers, made before it
            calls = messages[i].get("tool_calls") if messages[i].get("role") == "assistant" else None
            if call_id and calls and any(c.get("id") == call_id for c in calls):
                kept[i] = _said({**messages[i], "tool_calls": [c for c in calls if c.get("id") != call_id]})
                first = i
                break
    return first, [m for m in kept[first:] if m is not None]


def _said(message: Message) -> Message | None:
    """An assistant message as kept once an item of it is gone: None if it says nothing more."""
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    if message.get("content") in (None, "") and not any(message.get(k) for k in ("tool_calls", "refusal", "audio")):
        return None
    return message


def checked_metadata(value: Any) -> dict[str, str]:
    """A conversation's `metadata` as OpenAI takes it: at most 16 string keys of up to 64
    characters, each with a string of up to 512 (null: none)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'metadata' must be an object of string values", param="metadata")
    if len(value) > _METADATA_KEYS:
        raise BadRequest(f"'metadata' holds at most {_METADATA_KEYS} keys, got {len(value)}", param="metadata")
    for key, text in value.items():
        if len(key) > _KEY_CHARS:
            raise BadRequest(f"a 'metadata' key is at most {_KEY_CHARS} characters", param="metadata")
        if not isinstance(text, str) or len(text) > _VALUE_CHARS:
            raise BadRequest(f"'metadata.{key}' must be a string of at most {_VALUE_CHARS} characters",
                             param=f"metadata.{key}")
    return value


def checked_items(value: Any, required: bool) -> list[Item]:
    """The `items` of a create: an array of at most 20 (none at all where not `required`)."""
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise BadRequest("'items' must be a non-empty array of items" if required else "'items' must be an array",
                         param="items")
    if len(value) > MAX_NEW_ITEMS:
        raise BadRequest(f"'items' holds at most {MAX_NEW_ITEMS} items, got {len(value)}", param="items")
    return value
