"""Chat messages as plain data: validation, the canonical form, and chained hashes.

A conversation is the list of non-system messages after the leading system/developer prompt. Each
message gets a chained hash, sha256(parent hash + canonical JSON), so one hash identifies a message
together with everything before it: recognising how much of a resent history is already stored is a
lookup by hash, whatever the length of the stored history.

The canonical form keeps what changes meaning (role, content, name, tool calls, tool_call_id) and drops
what SDKs add or omit when they echo an assistant message back (`refusal: null`, `annotations: []`,
text-only content given as a list of parts), so the same message always hashes the same.

`loose_json` is a looser key used only to recognise a message a client sends back, never for hashing
(stored hashes must stay valid): tool-call arguments that parse as JSON compare by their value, since
some clients (LangChain) re-serialise them with other spacing; an image compares by the object its
URL names, without the signature a client that signs its media URLs makes anew for each request,
and whatever `detail` it asks for; a refusal compares the same as a part, as the field or as the
answer's text (the Vercel AI SDK resends it so), or left out (LangChain resends an empty answer);
text compares in Unicode's composed form (NFC) and with LF line ends, whichever a client resends;
and a message compares without its `name`, which some clients send with the newest message alone.
"""

from __future__ import annotations

import hashlib
import json
import time
import unicodedata
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import BadRequest

Message = dict[str, Any]

SYSTEM_ROLES = frozenset({"system", "developer"})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
ROOT_HASH = ""


# A media part of the Chat Completions API and the field that carries it.
_MEDIA_FIELDS = {"image_url": "image_url", "input_audio": "input_audio", "file": "file"}


def validate_messages(raw: Any, user_parts: frozenset[str] | None = None) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(raw):
        validate_message(message, f"messages[{i}]", user_parts)
    return raw


def validate_message(message: Any, where: str, user_parts: frozenset[str] | None = None) -> None:
    """One chat message as a client may send it; `where` names it in the error, `user_parts` the
    content part types a user message may hold (None: any)."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(
            f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
            param=f"{where}.role",
        )
    content = message.get("content")
    if content is None:
        # An assistant's may be left out beside its calls; a legacy function result's is required
        # but may be null (a function that returned nothing), as OpenAI takes it.
        if role != "assistant" and not (role == "function" and "content" in message):
            raise BadRequest(f"{where}.content is required", param=f"{where}.content")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(
                    f"{where}.content[{j}] must be an object with a 'type'",
                    param=f"{where}.content[{j}]",
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}].text must be a string",
                                 param=f"{where}.content[{j}].text")
            if user_parts is not None and role == "user" and part["type"] not in user_parts:
                raise BadRequest(f"{where}.content[{j}] has type {part['type']!r}, which a user message cannot hold"
                                 f" here; one of: {', '.join(sorted(user_parts))}", param=f"{where}.content[{j}].type")
            field = _MEDIA_FIELDS.get(part["type"])
            if field is not None and not isinstance(part.get(field), (dict, str)):
                # Stored, it would fail every later turn that sends it (litellm: a KeyError, a 502).
                raise BadRequest(f"{where}.content[{j}].{field} is required for a part of type '{part['type']}'",
                                 param=f"{where}.content[{j}].{field}")
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or an array", param=f"{where}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise BadRequest(f"{where}.tool_call_id is required", param=f"{where}.tool_call_id")
    if message.get("tool_call_id") is not None and not isinstance(message["tool_call_id"], str):
        raise BadRequest(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise BadRequest(f"{where}.tool_calls must be an array on an assistant message",
                             param=f"{where}.tool_calls")
        for j, call in enumerate(tool_calls):
            # A function's call, or a custom tool's (`{"type": "custom", "custom": {"name", "input"}}`).
            kind = "custom" if isinstance(call, dict) and call.get("type") == "custom" else "function"
            said = call.get(kind) if isinstance(call, dict) else None
            if not (isinstance(call, dict) and isinstance(call.get("id"), str)
                    and isinstance(said, dict) and isinstance(said.get("name"), str)):
                raise BadRequest(
                    f"{where}.tool_calls[{j}] must have an 'id' and a 'function' (a custom tool's call: a"
                    " 'custom') with a 'name'",
                    param=f"{where}.tool_calls[{j}]",
                )
            given = "input" if kind == "custom" else "arguments"
            if said.get(given) is not None and not isinstance(said[given], str):
                raise BadRequest(f"{where}.tool_calls[{j}].{kind}.{given} must be a string"
                                 f"{'' if kind == 'custom' else ' (of JSON)'}",
                                 param=f"{where}.tool_calls[{j}].{kind}.{given}")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"{where}.name must be a string", param=f"{where}.name")


def wire_form(message: Message) -> Message:
    """A message as it goes upstream: the openai client litellm sends with drops top-level null
    fields (an assistant's `content: null` beside its tool calls), so memproxy drops them itself and
    the admin context preview shows the very bytes sent. An assistant message with neither text nor
    a call (a refusal, an empty answer) gets empty text: OpenAI requires `content` unless the
    message calls a tool; a legacy function result of `content: null` gets empty text too (OpenAI
    takes the null, litellm leaves the key out, and OpenAI requires it); an answer's audio goes by its id alone, until the provider forgets it
    (its `expires_at`, less `AUDIO_EXPIRY_MARGIN`), and then as its transcript: OpenAI refuses an
    audio id past it. What the openai SDKs' parse helpers add to an answer an app keeps and
    sends back (`parsed`, a tool call's `parsed_arguments`: the SDK's reading of the content and
    arguments, which no chat API defines) is left out: a provider that checks its input strictly
    may refuse a field it does not know, and a session stores it where the client's own messages
    are stored (its first turn, an edit). A message with none of these is itself, not a
    copy: messages are never changed once built (stored ones are shared with the store's history
    cache)."""
    if message.get("role") == "assistant":
        calls = message.get("tool_calls")  # most answers have none: no generator made for them
        if "parsed" in message or (calls and any(
                isinstance(call, dict) and "parsed_arguments" in (call.get("function") or ()) for call in calls)):
            message = _unparsed(message)
        audio = message.get("audio")
        if isinstance(audio, dict) and _expired(audio):
            message = {**{k: v for k, v in message.items() if k != "audio"},
                       "content": message.get("content") or audio_transcript(message) or ""}
        elif isinstance(audio, dict) and audio.get("id") and set(audio) != {"id"}:
            message = {**message, "audio": {"id": audio["id"]}}
        if message.get("content") is None \
                and not any(message.get(key) for key in ("tool_calls", "function_call", "audio")):
            return {**{k: v for k, v in message.items() if v is not None}, "content": ""}
    if None not in message.values():
        return message
    if message.get("role") == "function" and message.get("content") is None:
        return {**{k: v for k, v in message.items() if v is not None}, "content": ""}
    return {k: v for k, v in message.items() if v is not None}


def _unparsed(message: Message) -> Message:
    """An assistant message without the openai SDKs' parse results (`wire_form`)."""
    out = {k: v for k, v in message.items() if k != "parsed"}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {**call, "function": {k: v for k, v in call["function"].items() if k != "parsed_arguments"}}
            if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
            for call in calls]
    return out


# The prompt-caching breakpoints (`cache_control`, on a message or a content part) Anthropic takes
# in one request, tools and system prompt included; OpenRouter and Bedrock pass them on to it.
CACHE_BREAKPOINTS = 4


def within_cache_breakpoints(messages: list[Message], new: int, tools: Any = None) -> list[Message]:
    """A planned request's messages (`new`: how many at the end are the client's new ones) with no
    more prompt-caching breakpoints, `tools` included, than `CACHE_BREAKPOINTS`. A client that marks
    its newest message each turn (Cline, Roo Code and Anthropic's docs mark the last user messages)
    has every stored message keep the mark it came with, and within a few turns every request of
    the session was refused. Where there are too many, the oldest stored messages' marks go first
    (a message's all at once); the system prompt's and the new messages' stay, as the client sent
    them. `messages` itself where nothing goes, the messages in it never changed."""
    marked = sum(isinstance(tool, dict) and tool.get("cache_control") is not None
                 for tool in (tools if isinstance(tools, list) else ()))
    # Counted inline, on every turn of every session: a call per message cost 0.85 ms at 1,000
    # messages (a long session sent whole), this 0.1 ms.
    for message in messages:
        if "cache_control" in message and message["cache_control"] is not None:
            marked += 1
        content = message.get("content")
        if content.__class__ is list:
            marked += sum(1 for part in content if part.__class__ is dict and part.get("cache_control") is not None)
    over = marked - CACHE_BREAKPOINTS
    if over <= 0:
        return messages
    out = list(messages)
    for i in range(len(out) - new):
        marks = _breakpoints(out[i]) if out[i].get("role") not in SYSTEM_ROLES else 0
        if marks:
            out[i], over = _unmarked(out[i]), over - marks
            if over <= 0:
                break
    return out


def _breakpoints(message: Message) -> int:
    content = message.get("content")
    parts = content if isinstance(content, list) else ()
    return int(message.get("cache_control") is not None) \
        + sum(isinstance(p, dict) and p.get("cache_control") is not None for p in parts)


def _unmarked(message: Message) -> Message:
    out = {k: v for k, v in message.items() if k != "cache_control"}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in p.items() if k != "cache_control"} if isinstance(p, dict) else p
                          for p in out["content"]]
    return out


AUDIO_EXPIRY_MARGIN = 300.0  # seconds: an answer's audio about to expire is sent as its transcript


def _expired(audio: dict[str, Any]) -> bool:
    expires_at = audio.get("expires_at")
    return isinstance(expires_at, (int, float)) and not isinstance(expires_at, bool) \
        and expires_at - AUDIO_EXPIRY_MARGIN <= time.time()


def audio_transcript(message: Message) -> str | None:
    """What an assistant said aloud: its audio answer's transcript (None: it spoke none)."""
    audio = message.get("audio")
    transcript = audio.get("transcript") if isinstance(audio, dict) else None
    return transcript if isinstance(transcript, str) and transcript else None


def detached(message: Message) -> Message:
    """A copy of a message that shares no list or dict with it, for code that may change what it is
    given (litellm rewrites content parts in place)."""
    return {k: _copied(v) for k, v in message.items()}


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def split_system(messages: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """The leading system/developer messages, and the conversation after them."""
    cut = 0
    while cut < len(messages) and messages[cut].get("role") in SYSTEM_ROLES:
        cut += 1
    return list(messages[:cut]), list(messages[cut:])


def canonical(message: Message) -> Message:
    out: Message = {"role": message.get("role")}
    content = _canonical_content(message.get("content"))
    if content not in (None, ""):
        out["content"] = content
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"id": call.get("id"), "name": name, "arguments": given or ""}
                             for call in calls for name, given in (called(call),)]
    if message.get("function_call"):
        out["function_call"] = message["function_call"]
    return out


def _canonical_content(content: Any) -> Any:
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def canonical_json(message: Message) -> str:
    return json.dumps(canonical(message), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loose_json(message: Message) -> str:
    """The canonical form with the text's surrounding whitespace left out and tool-call arguments
    that parse as JSON re-serialised canonically: two messages that differ only in how their
    arguments are spelt, or in the blank lines around their text (chat UIs trim an answer's final
    newline before they resend it), have the same loose form."""
    form = canonical(message)
    form.pop("name", None)  # a client may send it with the newest message and resend it without
    content = _content_key(message)
    if content is None:
        form.pop("content", None)
    else:
        form["content"] = content
    for call in form.get("tool_calls") or ():
        call["arguments"] = _loose_arguments(call["arguments"])
    return json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loosely_equal(a: Message, b: Message) -> bool:
    """Whether two messages have the same loose form; role and text are compared first, so telling
    most messages apart serialises nothing."""
    if a.get("role") != b.get("role"):
        return False
    if _content_key(a) != _content_key(b):
        # A refusal resent without it (LangChain's `ChatOpenAI` sends a refused answer back as an
        # empty one): the same message by its hash, which leaves a refusal out, so it must be here
        # too, or a client resending its newest messages stores and sends the empty answer again.
        return ("refusal" in a or "refusal" in b) and canonical_json(a) == canonical_json(b)
    return loose_json(a) == loose_json(b)


def said_within(inner: Message, outer: Message) -> bool:
    """Whether `inner` is `outer` less lines added before or after it: the same fields but its
    content, each of its text parts the whole of `outer`'s text or its first or last lines, each
    other part one of `outer`'s (loosely, as `loosely_equal` compares them). A chat UI's own record
    of a question it sent with retrieved context or a file's text added on lines of their own (Open
    WebUI adds them to the newest user message alone, after a newline). A question shortened within
    its lines (a secret cut out of it) is not the stored one: the client edited it."""
    if {k: v for k, v in inner.items() if k not in ("content", "name")} \
            != {k: v for k, v in outer.items() if k not in ("content", "name")}:
        return False
    texts, parts = _said(inner.get("content"))
    outer_texts, outer_parts = _said(outer.get("content"))
    whole = _normal_text("\n".join(outer_texts).strip())
    return all((said := _normal_text(text.strip())) and (said == whole or whole.startswith(said + "\n")
                                           or whole.endswith("\n" + said)) for text in texts) \
        and all(part in outer_parts for part in parts)


def _said(content: Any) -> tuple[list[str], list[Any]]:
    """A message content's texts, and its other parts in their loose form (`_loose_part`)."""
    if isinstance(content, str):
        return [content], []
    texts: list[str] = []
    parts: list[Any] = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            parts.append(_loose_part(part))
    return texts, parts


def _content_key(message: Message) -> Any:
    content = _canonical_content(message.get("content"))
    if isinstance(content, str):
        content = _normal_text(content.strip())
    elif isinstance(content, list):
        content = [_loose_part(part) for part in content]
    if content in (None, "", []) and isinstance(message.get("refusal"), str) and message["refusal"]:
        content = [{"type": "refusal", "refusal": message["refusal"]}]  # as the openai SDKs echo it
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "refusal" and isinstance(p.get("refusal"), str) for p in content):
        # As its text: the Vercel AI SDK makes a refusal the answer's text, and resends it so.
        return _normal_text("".join(p["refusal"] for p in content).strip())
    return None if content in (None, "") else content


def _normal_text(text: str) -> str:
    """Text as a resent message's is compared: in Unicode's composed form (NFC), its line ends as
    LF. "é" typed as one character or as "e" and a combining accent is the same text, and so are
    lines ended CRLF or LF: clients differ in which they resend (a UI or a store that
    normalises what it keeps, macOS input in the decomposed form, a Windows client's first send).
    Read as another message, a history resent so would be stored, and sent, twice."""
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n"))


def _loose_part(part: Any) -> Any:
    """A content part as a client may send it back: an image by the object its URL names,
    whatever `detail` it asks for this time; text as `_normal_text` compares it."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
        return {**part, "text": _normal_text(part["text"])}
    if kind == "image_url" and isinstance(part.get("image_url"), dict):
        url = part["image_url"].get("url")
        return {"type": kind, "url": _stable_url(url) if isinstance(url, str) else url}
    if kind == "input_image":
        url = part.get("image_url")
        return {"type": kind, "url": _stable_url(url) if isinstance(url, str) else url, "file_id": part.get("file_id")}
    return part


# The query parameters a signed URL carries (S3 and other SigV4 stores, GCS, CloudFront, Azure SAS):
# made anew with each signature, while the rest of the URL names the same object.
_SIGNATURE_PARAMETERS = frozenset({"x-amz-signature", "x-goog-signature", "signature", "sig"})
_SIGNING_PREFIXES = ("x-amz-", "x-goog-")
_SIGNING_PARAMETERS = frozenset({
    "signature", "expires", "key-pair-id", "policy", "awsaccesskeyid", "googleaccessid",  # S3 v2, GCS, CloudFront
    "sig", "se", "st", "sp", "sv", "sr", "spr", "srt", "ss", "sdd", "skoid", "sktid", "skt", "ske", "sks",
    "skv", "ses",  # Azure SAS
})


def _stable_url(url: str) -> str:
    """A signed URL without its signing parameters, which a client that signs its media URLs for
    each request changes every time: the same image (any other URL: itself)."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.query:
        return url
    pairs = parts.query.split("&")
    names = [pair.partition("=")[0].lower() for pair in pairs]
    if not _SIGNATURE_PARAMETERS.intersection(names):
        return url
    kept = [pair for pair, name in zip(pairs, names)
            if not (name.startswith(_SIGNING_PREFIXES) or name in _SIGNING_PARAMETERS)]
    return urlunsplit(parts._replace(query="&".join(kept)))


def _loose_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        # A call without parameters: some servers give its arguments as "" (llama.cpp, older vLLM
        # parsers), which clients parse as {} and send back so (LangChain).
        return "{}"
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the stack: compared as spelt
        return arguments


def chain_hash(parent: str, message: Message) -> str:
    digest = hashlib.sha256()
    digest.update(parent.encode())
    digest.update(b"\x00")
    # surrogatepass: a lone surrogate in a provider's answer hashes too (valid text is unaffected).
    digest.update(canonical_json(message).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def chain_hashes(parent: str, messages: Sequence[Message]) -> list[str]:
    hashes = []
    for message in messages:
        parent = chain_hash(parent, message)
        hashes.append(parent)
    return hashes


def history_end(messages: Sequence[Message]) -> int:
    """Where the newest exchange starts among `messages` that hold a conversation's history (an
    assistant answer before the latest user message), 0 where they hold none: new messages of a
    client's own, however long, hold no answer."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users or not any(m.get("role") == "assistant" for m in messages[: users[-1]]):
        return 0
    return users[-1]


def called(call: Any) -> tuple[Any, Any]:
    """A tool call's name and what it was given: a function's `name` and `arguments`, or a custom
    tool's `name` and `input` (`{"type": "custom", "custom": {...}}`, which OpenAI's models may
    answer with), as they are (either may be missing)."""
    if not isinstance(call, dict):
        return None, None
    said = call.get(call.get("type") or "function")
    said = said if isinstance(said, dict) else call.get("function") or {}
    return said.get("name"), said.get("arguments", said.get("input"))


def starts_unit(message: Message) -> bool:
    """Whether a cut may fall before this message: tool results belong to the call before them."""
    return message.get("role") not in ("tool", "function")


def unanswered_result(history: Sequence[Message], new: Sequence[Message]) -> int | None:
    """The index in `new` of the first tool result that answers no call of the assistant message
    its run of results follows (`history`: the messages `new` comes after), or None. Providers
    refuse a request holding such a result, every request after it alike."""
    calls: set[Any] = set()  # the calls of the assistant message the run of results follows
    for message in reversed(history):
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                calls = {c.get("id") for c in message.get("tool_calls") or []}
            break
    for i, message in enumerate(new):
        role = message.get("role")
        if role == "tool" and message.get("tool_call_id") not in calls:
            return i
        if role == "assistant":
            calls = {c.get("id") for c in message.get("tool_calls") or []}
        elif role != "tool":
            calls = set()
    return None


# What a model said to itself before answering, as providers and litellm name it: stored and shown,
# but not resent once its exchange is over (`without_reasoning`).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking_blocks")


def without_reasoning(message: Message) -> Message:
    """An assistant message as sent once its exchange is over: without its reasoning. Providers
    do not want it back (DeepSeek refuses a request that resends `reasoning_content`; OpenAI and
    Anthropic ignore or drop it), and it can be longer than the answer. Only an unfinished
    tool-call exchange sends it, verbatim (Anthropic's extended thinking requires its thinking
    blocks there). The message itself where it has none, never changed."""
    if message.get("role") != "assistant" or not any(key in message for key in REASONING_KEYS):
        return message
    return {k: v for k, v in message.items() if k not in REASONING_KEYS}


def assistant_message(message: Message) -> Message:
    """The assistant reply as stored: the response message without null fields, its reasoning
    kept (visible in the admin API and exports; `without_reasoning` says when it is sent). An answer
    of nothing (no content, calls, refusal or audio: a reasoning model that spent its whole output
    on thinking, a provider's filter) is stored with empty content: resent with null content and no
    calls, it would make every later request of the session one OpenAI refuses (a 400)."""
    out: Message = {"role": "assistant", "content": message.get("content")}
    for key in ("tool_calls", "function_call", "refusal", "audio", *REASONING_KEYS):
        value = message.get(key)
        if value:
            out[key] = value
    if out["content"] is None and not any(key in out for key in ("tool_calls", "function_call", "refusal", "audio")):
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_stored_call(call) for call in out["tool_calls"]]
    return out


def _stored_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as stored: its id, type, and its function's name and arguments, or a custom
    tool's name and input (which OpenAI wants back as `custom`, not as a function)."""
    if call.get("type") == "custom":
        custom = call.get("custom") or {}
        return {"id": call.get("id"), "type": "custom",
                "custom": {"name": custom.get("name"), "input": custom.get("input") or ""}}
    function = call.get("function") or {}
    return {"id": call.get("id"), "type": call.get("type") or "function",
            "function": {"name": function.get("name"), "arguments": function.get("arguments") or ""}}
