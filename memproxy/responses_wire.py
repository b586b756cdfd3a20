"""The Responses API's wire format, as plain functions over plain data: no I/O, no litellm.

memproxy serves `POST /v1/responses` with the chat pipeline (`memproxy.chat`): the request's input
items become chat messages (litellm's own bridge does that, `Provider.responses_input`), memory works
on those, and the answer comes back in the Responses shape. This module holds the rest of the
codec:

- `ResponsesRequest`: the body, checked (bad input is a 400 before anything is planned or stored);
- `output_items` / `response_object`: an assistant chat message into the Response object's
  `output` items (reasoning, message, function calls, in that order) and the object itself;
- `ChatEvents`: a chat-completion stream into the Responses stream's events, in the order the
  openai SDK assembles them (`response.created`, each item added, its deltas, each item done,
  `response.completed`);
- `input_items`: chat messages back into Responses input items, for a provider that speaks the
  Responses API itself (`responses_api: native`);
- the usage both ways.

Ids are memproxy's own (`resp_` and 24 hex digits; an item's `msg_`, `fc_`, `rs_`, those digits and
its place, `item_ids`): a response is kept and found by its id whatever the provider, and an item
by its response's.
"""

from __future__ import annotations

import copy
import itertools
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import BadRequest
from .jsonbytes import dumps
from .messages import Message, SYSTEM_ROLES, audio_transcript, called

Item = dict[str, Any]
Event = dict[str, Any]
Status = Literal["completed", "incomplete"]

# The body's keys memproxy reads itself; the rest are the model's parameters.
REQUEST_KEYS = frozenset({"model", "input", "instructions", "stream", "store", "previous_response_id",
                          "conversation"})
# Parameters a Response object echoes back, as sent (None where the request set none).
_ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "reasoning", "temperature",
           "text", "tool_choice", "tools", "top_p", "truncation", "user", "previous_response_id", "top_logprobs",
           "max_tool_calls", "prompt_cache_key", "safety_identifier", "service_tier")
_DEFAULTS: dict[str, Any] = {"parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": 1.0,
                             "top_p": 1.0, "truncation": "disabled", "text": {"format": {"type": "text"}},
                             "metadata": {}, "service_tier": "default"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def item_ids(response_id: str) -> Callable[[str], str]:
    """Ids for the items of one response (its output, and input items the client sent without one)
    that name it: `msg_<the response id's hex>_<n>`, so that an `item_reference` to one is looked
    up by its response's key (`response_of_item`), as OpenAI resolves those it stored."""
    own = response_id.removeprefix("resp_")
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{own}_{next(counter)}"


# An item's id begins with its kind's prefix (`msg_...`, `fc_...`).
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                 "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}
_ITEM_ID = re.compile(r"[a-z]+_([0-9a-f]{24})_[0-9]+")


def response_of_item(item_id: str) -> str | None:
    """The id of the response an item id of memproxy's names (`item_ids`); None for any other."""
    match = _ITEM_ID.fullmatch(item_id)
    return f"resp_{match[1]}" if match else None


@dataclass(frozen=True)
class ResponsesRequest:
    """A `POST /v1/responses` body, checked."""

    model: str
    input: str | list[Item]
    instructions: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    conversation: str | None
    body: dict[str, Any] = field(repr=False)  # as sent

    @property
    def input_list(self) -> list[Item]:
        """The input as items, as `input_items` lists them (OpenAI's form): a string is one user
        message, and a message in short form (`{"role", "content": "text"}`) gets its type and its
        text as a part (`output_text` for an assistant's, `input_text` for the others)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return [listed_item(item) for item in self.input]

    @property
    def params(self) -> dict[str, Any]:
        """The model's parameters: everything but what memproxy reads itself."""
        return {k: v for k, v in self.body.items() if k not in REQUEST_KEYS}


def listed_item(item: Item) -> Item:
    """An item as `input_items` lists it: a message in short form given its type and text parts."""
    if item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {**item, "type": "message", "content": content}


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required", param="model")
    raw = body.get("input")
    if isinstance(raw, str):
        if not raw:
            raise BadRequest("'input' must not be empty", param="input")
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            check_item(item, f"input[{i}]")
    else:
        raise BadRequest("'input' must be a string or a non-empty array of items", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    for key in ("stream", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"'{key}' must be a boolean", param=key)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("'previous_response_id' must be a response id", param="previous_response_id")
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
        if not isinstance(conversation, str):
            raise BadRequest("'conversation.id' must be a string", param="conversation.id")
    elif conversation is not None and not isinstance(conversation, str):
        raise BadRequest("'conversation' must be a conversation id or {\"id\": ...}", param="conversation")
    if conversation is not None and previous is not None:
        raise BadRequest("'previous_response_id' and 'conversation' cannot both be given", param="conversation")
    for key in ("tools", "include"):
        if body.get(key) is not None and not isinstance(body[key], list):
            raise BadRequest(f"'{key}' must be an array", param=key)
    for key in ("text", "reasoning"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise BadRequest(f"'{key}' must be an object", param=key)
    for key in ("effort", "summary"):
        value = (body.get("reasoning") or {}).get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"'reasoning.{key}' must be a string", param=f"reasoning.{key}")
    if body.get("truncation") is not None and not isinstance(body["truncation"], str):
        raise BadRequest("'truncation' must be a string", param="truncation")
    max_output = body.get("max_output_tokens")
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1):
        raise BadRequest("'max_output_tokens' must be a positive integer", param="max_output_tokens")
    return ResponsesRequest(model=model, input=raw, instructions=instructions, stream=bool(body.get("stream")),
                            store=body.get("store") is not False, previous_response_id=previous,
                            conversation=conversation, body=body)


_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning", "item_reference",
                         "custom_tool_call", "custom_tool_call_output"})
_CUSTOM_ITEMS = frozenset({"custom_tool_call", "custom_tool_call_output"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# The message content parts memory keeps; any other would be dropped or emptied on the way.
_PARTS = _TEXT_PARTS | {"refusal", "input_image", "input_file", "input_audio"}


def check_item(item: Any, where: str) -> None:
    """An input item of the kinds memory keeps: messages (a role and content), function calls and
    custom tools' calls (GPT-5's free-form tools) and their outputs, reasoning. Other kinds
    (built-in tool calls) are the provider's; memproxy cannot replay them on another provider, so
    they are refused rather than silently dropped."""
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _ITEM_TYPES:
        raise BadRequest(f"{where}.type must be one of {', '.join(sorted(_ITEM_TYPES))}, got {kind!r}",
                         param=f"{where}.type")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(sorted(_ROLES))}", param=f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(f"{where}.content[{j}] must be an object with a 'type'",
                                     param=f"{where}.content[{j}]")
                if part["type"] not in _PARTS:
                    raise BadRequest(f"{where}.content[{j}].type must be one of {', '.join(sorted(_PARTS))}",
                                     param=f"{where}.content[{j}].type")
                if part["type"] in _TEXT_PARTS and not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}.content[{j}].text must be a string",
                                     param=f"{where}.content[{j}].text")
                if part["type"] == "input_image" and not any(isinstance(part.get(k), str) and part[k]
                                                             for k in ("image_url", "file_id")):
                    raise BadRequest(f"{where}.content[{j}] needs an image_url or a file_id",
                                     param=f"{where}.content[{j}]")
                if part["type"] == "input_file" and not any(isinstance(part.get(k), str) and part[k]
                                                            for k in ("file_data", "file_id", "file_url")):
                    raise BadRequest(f"{where}.content[{j}] needs a file_data, a file_id or a file_url",
                                     param=f"{where}.content[{j}]")
        elif not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or an array", param=f"{where}.content")
    elif kind in ("function_call", "custom_tool_call"):
        for key in ("call_id", "name", "arguments" if kind == "function_call" else "input"):
            if not isinstance(item.get(key), str):
                raise BadRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    elif kind == "item_reference":
        if not isinstance(item.get("id"), str) or not item["id"]:
            raise BadRequest(f"{where}.id must be an item id", param=f"{where}.id")
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise BadRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
        if not isinstance(item.get("output"), (str, list)):
            raise BadRequest(f"{where}.output must be a string or an array", param=f"{where}.output")


# --- an assistant chat message as Response output ---------------------------------------------------


def output_items(message: Message, make_id: Callable[[str], str] = new_id, logprobs: Any = None) -> list[Item]:
    """The output items of an assistant chat message: its reasoning, its text (with its choice's
    `logprobs` where the provider gave them), its tool calls."""
    items: list[Item] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(make_id("rs"), reasoning))
    text = _text(message.get("content"))
    refusal = message.get("refusal")
    if text or (isinstance(refusal, str) and refusal):
        item = message_item(make_id("msg"), text)
        if text and (tokens := text_logprobs(logprobs)):
            item["content"][0]["logprobs"] = tokens
        if isinstance(refusal, str) and refusal:  # the model declined: a refusal part, as OpenAI's Responses say it
            item["content"] = [*(item["content"] if text else []), {"type": "refusal", "refusal": refusal}]
        items.append(item)
    for call in message.get("tool_calls") or []:
        call_id = str(call.get("id") or make_id("call"))
        if call.get("type") == "custom":
            items.append({"type": "custom_tool_call", "id": make_id("ctc"), **custom_call(call, call_id)})
            continue
        function = call.get("function") or {}
        items.append(call_item(make_id("fc"), call_id, str(function.get("name") or ""), _arguments(function)))
    return items


def custom_call(call: dict[str, Any], call_id: str) -> Item:
    """A chat custom tool's call as a Responses `custom_tool_call` says it (less its type and id)."""
    name, given = called(call)
    return {"call_id": call_id, "name": str(name or ""), "input": str(given or "")}


def text_logprobs(logprobs: Any) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) `logprobs` as a Responses `output_text` gives them: each token
    with its bytes, its log probability and its `top_logprobs` (the same fields, in another place)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return []
    return [{"token": entry.get("token", ""), "bytes": entry.get("bytes") or [], "logprob": entry.get("logprob", 0.0),
             "top_logprobs": [{"token": top.get("token", ""), "bytes": top.get("bytes") or [],
                               "logprob": top.get("logprob", 0.0)}
                              for top in entry.get("top_logprobs") or [] if isinstance(top, dict)]}
            for entry in content if isinstance(entry, dict)]


def message_item(item_id: str, text: str, status: str = "completed") -> Item:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _arguments(function: dict[str, Any]) -> str:
    """A chat tool call's arguments as a Responses `function_call` gives them: `{}` for a call
    without parameters whose provider gave none or "" (OpenAI's Responses API never does, and
    clients parse its arguments as JSON)."""
    return str(function.get("arguments") or "") or "{}"


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str) -> Item:
    return {"type": "reasoning", "id": item_id, "summary": [{"type": "summary_text", "text": text}] if text else []}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def response_object(response_id: str, request: ResponsesRequest, model: str, output: list[Item],
                    usage: dict[str, Any] | None, status: str = "completed",
                    created_at: float | None = None, finish_reason: Any = None) -> dict[str, Any]:
    """A Response object: what `POST /v1/responses` answers, `GET` returns and a stream completes with.
    `model` is the model the client named; the request's parameters are echoed as OpenAI does."""
    body = request.body
    echoed = {key: body[key] if body.get(key) is not None else _DEFAULTS.get(key) for key in _ECHOED}
    if status == "incomplete" and output and "status" in output[-1]:
        output = [*output[:-1], {**output[-1], "status": "incomplete"}]  # the item the answer was cut in
    result: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": int(created_at or time.time()), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,  # answered in the foreground, whatever the request asked
        "error": None,
        "incomplete_details": {"reason": _INCOMPLETE.get(finish_reason, "max_output_tokens")}
        if status == "incomplete" else None,
        "model": model, "output": output, **echoed, "store": request.store,
        "usage": usage,
    }
    if request.conversation is not None:
        result["conversation"] = {"id": request.conversation}
    return result


# A chat answer's finish reasons that leave a Response incomplete, and the reason it gives.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def status_of(finish_reason: Any) -> Status:
    return "incomplete" if finish_reason in _INCOMPLETE else "completed"


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat completion's usage in the Responses shape."""
    if not usage:
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Response's usage in the chat shape memproxy records (`prompt_tokens`, `completion_tokens`)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- a chat-completion stream as Responses events ---------------------------------------------------


class ChatEvents:
    """A chat-completion stream (choice 0) into Responses events. Items open as their first delta
    arrives and close, in order, when the stream ends (`finish`), before `response.completed`, which
    the caller sends once the turn is recorded (`completed`)."""

    def __init__(self, response: dict[str, Any], make_id: Callable[[str], str] = new_id) -> None:
        self._response = response  # the Response as created: status in_progress, no output
        self._make_id = make_id
        self._seq = 0
        self.items: list[Item] = []  # every item opened, in output order, as it stands
        self._reasoning: int | None = None  # output index of the open reasoning item
        self._message: int | None = None
        self._parts: dict[str, int] = {}  # the open message's content parts by type: output_text, refusal
        self._calls: dict[int, int] = {}  # the chat tool call's index -> its output index
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def numbered(self, event: Event) -> Event:
        """A provider's own event (a native stream's), numbered in this stream: as the provider
        numbered it where it numbered every event from 0 (OpenAI does), and where it did not
        (litellm, faking a stream for a model that has none, numbers few), numbered all the same.
        An event of memproxy's (the error ending the stream) is numbered after it."""
        event = {**event, "sequence_number": self._seq}
        self._seq += 1
        return event

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._response),
                self._event("response.in_progress", response=self._response)]

    def add(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning_delta(str(delta["reasoning_content"]))
            if delta.get("content"):
                events += self._part_delta("output_text", str(delta["content"]), text_logprobs(choice.get("logprobs")))
            if delta.get("refusal"):
                events += self._part_delta("refusal", str(delta["refusal"]))
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _open(self, item: Item) -> tuple[int, Event]:
        self.items.append(item)
        index = len(self.items) - 1
        # A copy as it stands: the item grows with the deltas that follow, before this event is sent.
        return index, self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))

    def _reasoning_delta(self, text: str) -> list[Event]:
        events = []
        if self._reasoning is None:
            index, added = self._open(reasoning_item(self._make_id("rs"), ""))
            self._reasoning = index
            item = self.items[index]
            item["summary"] = [{"type": "summary_text", "text": ""}]
            events += [added, self._event("response.reasoning_summary_part.added", item_id=item["id"],
                                          output_index=index, summary_index=0,
                                          part={"type": "summary_text", "text": ""})]
        item = self.items[self._reasoning]
        item["summary"][0]["text"] += text
        return [*events, self._event("response.reasoning_summary_text.delta", item_id=item["id"],
                                     output_index=self._reasoning, summary_index=0, delta=text)]

    def _part_delta(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """Text of the message's answer (`output_text`, with its tokens' `logprobs` where the
        provider gave them) or of its refusal (`refusal`)."""
        events = []
        if self._message is None:
            index, added = self._open(message_item(self._make_id("msg"), "", status="in_progress"))
            self._message = index
            events.append(added)
        item = self.items[self._message]
        if kind not in self._parts:
            part = {"type": "output_text", "text": "", "annotations": []} if kind == "output_text" \
                else {"type": "refusal", "refusal": ""}
            self._parts[kind] = len(item["content"])
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._message,
                                      content_index=self._parts[kind], part=dict(part)))
        at = self._parts[kind]
        if kind == "output_text":
            item["content"][at]["text"] += text
            if logprobs:
                item["content"][at].setdefault("logprobs", []).extend(logprobs)
            return [*events, self._event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                         content_index=at, delta=text, logprobs=logprobs or [])]
        item["content"][at]["refusal"] += text
        return [*events, self._event("response.refusal.delta", item_id=item["id"], output_index=self._message,
                                     content_index=at, delta=text)]

    def _call_delta(self, delta: dict[str, Any]) -> list[Event]:
        events = []
        position = int(delta.get("index", len(self._calls)))
        function = delta.get("function") or {}
        if position not in self._calls:
            index, added = self._open(call_item(self._make_id("fc"), str(delta.get("id") or self._make_id("call")),
                                                str(function.get("name") or ""), "", status="in_progress"))
            self._calls[position] = index
            events.append(added)
        item = self.items[self._calls[position]]
        if function.get("name") and item["name"] != function["name"]:
            item["name"] = function["name"] if not item["name"] else item["name"] + function["name"]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._calls[position], delta=function["arguments"]))
        return events

    def finish(self) -> list[Event]:
        """Every open item done, in output order; the last one incomplete where the answer was cut
        short (its length, a content filter), as OpenAI's is."""
        events: list[Event] = []
        cut = status_of(self.finish_reason) == "incomplete"
        for index, item in enumerate(self.items):
            done = "incomplete" if cut and index == len(self.items) - 1 else "completed"
            if item["type"] == "reasoning":
                part = item["summary"][0]
                events += [self._event("response.reasoning_summary_text.done", item_id=item["id"],
                                       output_index=index, summary_index=0, text=part["text"]),
                           self._event("response.reasoning_summary_part.done", item_id=item["id"],
                                       output_index=index, summary_index=0, part=dict(part))]
            elif item["type"] == "message":
                item["status"] = done
                for at, part in enumerate(item["content"]):
                    if part["type"] == "refusal":
                        events.append(self._event("response.refusal.done", item_id=item["id"], output_index=index,
                                                  content_index=at, refusal=part["refusal"]))
                    else:
                        events.append(self._event("response.output_text.done", item_id=item["id"],
                                                  output_index=index, content_index=at, text=part["text"],
                                                  logprobs=part.get("logprobs", [])))
                    events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                              content_index=at, part=dict(part)))
            else:
                item["status"] = done
                item["arguments"] = item["arguments"] or "{}"  # a call without parameters: see `_arguments`
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def completed(self, response: dict[str, Any]) -> Event:
        kind = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def error(self, error: dict[str, Any]) -> Event:
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"),
                           error=error)


def as_opened(event: Event) -> Event:
    """A native stream's event with the item or part it adds as OpenAI's stream adds them, empty:
    a message without content, a function call without arguments, a text or refusal part without
    text, the text's events with their `logprobs`. litellm, faking a stream for a model that has
    none (o1-pro), adds them whole and then sends their text as deltas too, which the SDK's stream
    helper appends to them: every delta's `snapshot` read the answer twice over."""
    kind, item, part = event.get("type"), event.get("item"), event.get("part")
    if kind == "response.output_item.added" and isinstance(item, dict):
        if item.get("type") == "message":
            return {**event, "item": {**item, "status": "in_progress", "content": []}}
        if item.get("type") == "function_call":
            return {**event, "item": {**item, "status": "in_progress", "arguments": ""}}
    if kind == "response.content_part.added" and isinstance(part, dict) and part.get("type") in _PART_TEXT:
        return {**event, "part": {**part, _PART_TEXT[part["type"]]: ""}}
    if kind in ("response.output_text.delta", "response.output_text.done") and event.get("logprobs") is None:
        return {**event, "logprobs": []}
    return event


_PART_TEXT = {"output_text": "text", "refusal": "refusal"}  # a message part's kind -> the field holding its text


def sse(event: Event) -> bytes:
    """An event on the wire; a lone surrogate in an answer as its JSON escape (`jsonbytes.dumps`), never
    as bytes that are not UTF-8, which an SDK's decoder refuses mid-stream."""
    return f"event: {event['type']}\ndata: ".encode() + dumps(event) + b"\n\n"


# --- chat messages as Responses input, for a provider that speaks the Responses API -----------------


def input_items(messages: Iterable[Message], custom_calls: Iterable[str] = ()) -> list[Item]:
    """Chat messages (what memory decided to send) as Responses input items: system and developer
    messages as messages of that role, an assistant's text and tool calls as a message and
    function calls (a custom tool's as a custom tool call), tool results as the outputs of the
    calls they answer (`custom_calls`: custom tools' calls made before `messages`). Reasoning is
    not sent: without the provider's own item (its id or encrypted content) a provider cannot take
    it back."""
    items: list[Item] = []
    custom = set(custom_calls)  # the ids of custom tools' calls: their results are custom tool call outputs
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "tool":
            call_id = str(message.get("tool_call_id") or "")
            items.append({"type": "custom_tool_call_output" if call_id in custom else "function_call_output",
                          "call_id": call_id, "output": _tool_output(content)})
        elif role == "assistant":
            refusal = message.get("refusal")
            # An answer spoken or refused holds no text: what it said goes back as text.
            text = _text(content) or audio_transcript(message) or (refusal if isinstance(refusal, str) else "")
            if text:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})
            for call in message.get("tool_calls") or []:
                if call.get("type") == "custom":
                    custom.add(str(call.get("id") or ""))
                    items.append({"type": "custom_tool_call", **custom_call(call, str(call.get("id") or ""))})
                    continue
                function = call.get("function") or {}
                items.append({"type": "function_call", "call_id": str(call.get("id") or ""),
                              "name": str(function.get("name") or ""),
                              "arguments": _arguments(function)})
        else:
            items.append({"type": "message", "role": role if role in SYSTEM_ROLES or role == "user" else "user",
                          "content": _input_content(content)})
    return items


def _tool_output(content: Any) -> Any:
    """A tool result's content as a call output's `output`: its text, or, where it holds an image or
    a file (a `function_call_output` may), its parts as Responses input parts, none of them lost."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return _input_content(content)
    return content if isinstance(content, str) else _text(content)


def _input_content(content: Any) -> Any:
    """A chat message's content as a Responses message's: text parts become `input_text`, image
    parts `input_image`, file parts `input_file`; a string stays a string."""
    if not isinstance(content, list):
        return content if isinstance(content, str) else ""
    parts = []
    for part in content:
        if part.get("type") == "text":
            parts.append({"type": "input_text", "text": part.get("text", "")})
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            parts.append({"type": "input_image", "image_url": url.get("url") if isinstance(url, dict) else url,
                          "detail": (url.get("detail") if isinstance(url, dict) else None) or "auto"})
        elif part.get("type") == "file" and isinstance(part.get("file"), dict):
            file = part["file"]
            parts.append({"type": "input_file", **{k: file[k] for k in ("file_id", "file_data", "filename")
                                                   if isinstance(file.get(k), str)}})
        else:
            parts.append(part)
    return parts


# The tools litellm's bridge gives a chat completion: functions (a namespace's too), and web search
# as chat's `web_search_options`.
_BRIDGED_TOOLS = frozenset({"function", "namespace", "web_search", "web_search_preview"})


def check_bridge_input(request: ResponsesRequest) -> None:
    """A request for a model reached as chat completions (`responses_api: bridge`): parts the
    bridge would empty or drop are refused, never sent changed and stored so: an image by file id
    (a chat provider takes images by URL; litellm's bridge sends an empty one), audio (dropped) and
    a file by URL (chat completions take a file's data or id only; the bridge sends the URL as an
    id). Custom tools (GPT-5's free-form tools) too: litellm's bridge makes each a function taking
    `{"content": ...}`, which the client's next turn would not send back as it came. And the
    built-in tools chat completions have no form for (`file_search`, `image_generation`, `mcp`, ...):
    litellm's bridge drops some without a word and sends the others to a provider that has no such
    tool; `web_search` goes, as chat's `web_search_options`."""
    tools = request.params.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "custom":
            raise BadRequest(f"tools[{i}]: a custom tool cannot reach this model, which takes the Responses API "
                             "as chat completions (responses_api: bridge); use a function tool, or a model with "
                             "responses_api: native", param=f"tools[{i}]")
        if isinstance(kind, str) and kind not in _BRIDGED_TOOLS:
            raise BadRequest(f"tools[{i}]: the built-in tool {kind!r} cannot reach this model, which takes the "
                             "Responses API as chat completions (responses_api: bridge); use a function tool, or "
                             "a model with responses_api: native", param=f"tools[{i}]")
    check_bridge_items(request.input if isinstance(request.input, list) else [])


def check_bridge_items(items: list[Item], name: str = "input") -> None:
    """`check_bridge_input` over items (`name`: the field that holds them, as errors name it)."""
    for i, item in enumerate(items):
        if item.get("type") in _CUSTOM_ITEMS:
            raise BadRequest(f"{name}[{i}]: a custom tool's call or output cannot reach this model, which takes the "
                             "Responses API as chat completions (responses_api: bridge); use a model with "
                             "responses_api: native", param=f"{name}[{i}]")
        content = item.get("content") if item.get("type", "message") == "message" else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type")
            if kind == "input_audio" or (kind == "input_image" and not part.get("image_url")):
                raise BadRequest(f"{name}[{i}].content[{j}]: an input_image by file_id, or input_audio, cannot "
                                 "reach this model, which takes the Responses API as chat completions "
                                 "(responses_api: bridge); send the image by URL, or use a model with "
                                 "responses_api: native", param=f"{name}[{i}].content[{j}]")
            if kind == "input_file" and not (part.get("file_id") or part.get("file_data")):
                raise BadRequest(f"{name}[{i}].content[{j}]: an input_file by file_url cannot reach this model, "
                                 "which takes the Responses API as chat completions (responses_api: bridge); send "
                                 "its file_data (with its filename) or a file_id, or use a model with "
                                 "responses_api: native", param=f"{name}[{i}].content[{j}]")


# --- lists of items, a page at a time ---------------------------------------------------------------


def item_page(items: list[Item], query: Mapping[str, str], unknown_after: str) -> dict[str, Any]:
    """A page of `items` (in stored order) as OpenAI lists items: `limit` 1-100 (default 20),
    `order` desc by default, `after` the id of the item before the page (`unknown_after`: the
    error's message where no item has it)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be asc or desc", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be an integer from 1 to 100", param="limit")
    items = list(items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise BadRequest(unknown_after, param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}
