"""The token-cost replay: LoCoMo's long conversations through memproxy with a modest window.

Speaker A's turns are the user's messages and speaker B's the assistant's answers (consecutive lines
of one speaker are one message; a session's first message carries its date, a shared photo its
caption). The fake upstream answers each request with speaker B's recorded reply, so the stored
history is the real conversation. The client sends only its new message; memproxy adds the rest.

Measured: the prompt tokens memproxy sent upstream (its own count, `X-Memproxy-Context-Tokens`,
checked against the upstream's count) plus what its summariser's requests cost, against a client
that resends the whole conversation every time (counted with the same tokenizer), and how many of
those full requests would not have fit in the window at all (a hard 400 from the provider).

The data (LoCoMo, CC BY-NC 4.0) is read in place and never copied into the repository.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from memproxy.tokens import TiktokenCounter, request_tokens
from upstream import digest

# shared/ sits beside the repository (as in CI's clone); /work/shared is where a session finds it.
_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo5.json"
DATA = _BESIDE if _BESIDE.exists() else Path("/work/shared/data/locomo5.json")
SYSTEM_TEMPLATE = "You are {b}, chatting with your friend {a}. Reply as {b} would, warmly and briefly."


@dataclass
class Conversation:
    name: str
    system: str
    exchanges: list[tuple[str, str]]  # (user message, recorded reply)


@dataclass
class ReplayResult:
    name: str
    requests: int = 0
    full_tokens: list[int] = field(default_factory=list)  # a client resending everything
    sent_tokens: list[int] = field(default_factory=list)  # what memproxy sent, per request
    overflowed: int = 0  # full requests that would not fit the window
    refused: int = 0  # requests memproxy answered with an error
    summary_version: int = 0


def data_path(explicit: str | None = None) -> Path:
    return Path(explicit) if explicit else DATA


def licence(data: Path) -> str | None:
    """The licence of the data as the licence file beside it names it (its first line), if there is one."""
    for candidate in sorted(data.parent.glob("*LICEN[CS]E*")):
        lines = [line.strip() for line in candidate.read_text(encoding="utf-8", errors="replace").splitlines()]
        named = next((line for line in lines if line), None)
        if named:
            return f"{named} ({candidate.name})"
    return None


def load_conversations(path: Path, limit_exchanges: int | None = None,
                       limit_conversations: int | None = None) -> list[Conversation]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    conversations: list[Conversation] = []
    for item in raw[:limit_conversations]:
        conv = item["conversation"]
        a, b = conv["speaker_a"], conv["speaker_b"]
        numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
        segments: list[tuple[str, str]] = []  # (speaker, text), one speaker's consecutive lines joined
        for n in numbers:
            date = conv.get(f"session_{n}_date_time", "")
            for i, turn in enumerate(conv[f"session_{n}"]):
                text = f"[{turn['dia_id']}] {turn['text']}"
                if turn.get("blip_caption"):
                    text += f" [shares a photo: {turn['blip_caption']}]"
                if i == 0 and date:
                    text = f"({date}) {text}"
                if segments and segments[-1][0] == turn["speaker"]:
                    segments[-1] = (turn["speaker"], segments[-1][1] + "\n" + text)
                else:
                    segments.append((turn["speaker"], text))
        if segments and segments[0][0] != a:
            segments.insert(0, (a, "[start] Hi!"))
        exchanges = []
        for i in range(0, len(segments), 2):
            reply = segments[i + 1][1] if i + 1 < len(segments) else "(no reply)"
            exchanges.append((segments[i][1], reply))
        conversations.append(Conversation(item.get("sample_id", f"conv-{len(conversations)}"),
                                          SYSTEM_TEMPLATE.format(a=a, b=b), exchanges[:limit_exchanges]))
    return conversations


def replies(conversations: list[Conversation]) -> dict[str, str]:
    return {digest(user): reply for c in conversations for user, reply in c.exchanges}


async def replay(session: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str,
                 conversation: Conversation, counter: TiktokenCounter, window: int,
                 output_reserve: int) -> ReplayResult:
    result = ReplayResult(conversation.name)
    history: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
    for user, _ in conversation.exchanges:
        message = {"role": "user", "content": user}
        full = request_tokens(counter, [*history, message], [])
        result.full_tokens.append(full)
        if full + output_reserve > window:
            result.overflowed += 1
        body = {"model": model, "messages": [history[0], message]}
        async with session.post(url, json=body, headers={
            **headers, "X-Session-Id": f"locomo-{conversation.name}", "X-Memproxy-History": "new",
        }) as response:
            answer = await response.json()
            result.requests += 1
            if response.status != 200:
                result.refused += 1
                result.sent_tokens.append(0)
                continue
            result.sent_tokens.append(int(response.headers.get("X-Memproxy-Context-Tokens", "0")))
            result.summary_version = int(response.headers.get("X-Memproxy-Summary-Version", "0"))
        reply = answer["choices"][0]["message"]["content"]
        history += [message, {"role": "assistant", "content": reply}]
    return result


async def replay_all(url: str, headers: dict[str, str], model: str, conversations: list[Conversation],
                     encoding: str, window: int, output_reserve: int) -> list[ReplayResult]:
    counter = TiktokenCounter(encoding)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(
            replay(session, url, headers, model, c, counter, window, output_reserve) for c in conversations
        )))
