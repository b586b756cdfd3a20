"""The recall quality replay: LoCoMo's conversations told to memproxy turn by turn, then every
question asked as the next request, scored by how much of its evidence would reach the model.

Each dialog turn is sent as it was said, tagged with its id: `[D1:3] Caroline: text` (with
` [shares a photo: caption]` where the turn shares one). Speaker A is the user and speaker B the
assistant; one speaker's consecutive turns are one message, and the client sends only its new
messages (`X-Memproxy-History: new`). A session that opens with speaker B sends those turns as a
user message too, in the same request as speaker A's turns that follow. The fake upstream answers each
request with the speaker B turns that follow in the script, keyed by the request's last user message
(`replies`), so the stored history is the dialog itself; an exchange that ends a session with no
answer gets `NO_REPLY`, which holds no dialog id.

Then each question whose evidence is known goes to the context endpoint as the next user message
(nothing is stored), and its score is the share of its evidence ids whose tag appears anywhere in the
messages memproxy would send upstream. The same replayed store is asked once per memory setting, so
the settings are compared on identical histories. Nothing here knows LoCoMo's questions: no rule or
word list is drawn from them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from load import leading_int
from upstream import digest

SYSTEM_TEMPLATE = "You are {b}, chatting with your friend {a}. Reply as {b} would, warmly and briefly."
NO_REPLY = "(no reply)"
TAG = re.compile(r"\[(D\d+:\d+)\]")
# Evidence ids as LoCoMo writes them, odd ones included: "D8:6; D9:17" (two), "D:11:26" (D11:26).
EVIDENCE_ID = re.compile(r"D:?(\d+):(\d+)")
CATEGORIES = ("1", "2", "3", "4", "5")
CATEGORY_NAMES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "5": "adversarial"}


@dataclass
class Exchange:
    messages: list[str]  # the request's new user messages: one per run of one speaker's turns
    reply: str  # what the fake upstream answers: speaker B's turns that follow, or NO_REPLY


@dataclass
class Question:
    text: str
    category: str
    evidence: list[str]  # dia ids, normalised


@dataclass
class Script:
    name: str
    system: str
    exchanges: list[Exchange]
    questions: list[Question]
    sessions: int
    opened_by_b: int  # sessions opening with speaker B, whose turns were sent as a user message
    evidence_dropped: int  # evidence entries with no dia id in them (LoCoMo has one bare "D")


@dataclass
class Score:
    """Summed scores and counts by category, so that runs and conversations add up."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, category: str, share: float) -> None:
        self.sums[category] = self.sums.get(category, 0.0) + share
        self.counts[category] = self.counts.get(category, 0) + 1

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def merge(self, other: Score) -> None:
        for category, total in other.sums.items():
            self.sums[category] = self.sums.get(category, 0.0) + total
            self.counts[category] = self.counts.get(category, 0) + other.counts[category]
        for kind, n in other.errors.items():
            self.errors[kind] = self.errors.get(kind, 0) + n

    def summary(self) -> dict[str, Any]:
        total = sum(self.counts.values())
        return {
            "questions": total,
            "overall": sum(self.sums.values()) / total if total else None,
            "by_category": {c: {"questions": self.counts[c], "recall": self.sums[c] / self.counts[c]}
                            for c in CATEGORIES if self.counts.get(c)},
            "errors": self.errors,
        }


def turn_text(turn: dict[str, Any]) -> str:
    text = f"[{turn['dia_id']}] {turn['speaker']}: {turn['text']}"
    if turn.get("blip_caption"):
        text += f" [shares a photo: {turn['blip_caption']}]"
    return text


def evidence_ids(entries: Sequence[str]) -> tuple[list[str], int]:
    """The dia ids named by a question's evidence (several to an entry at times), and how many
    entries named none."""
    ids: list[str] = []
    dropped = 0
    for entry in entries:
        found = [f"D{int(d)}:{int(t)}" for d, t in EVIDENCE_ID.findall(entry)]
        dropped += not found
        ids += [i for i in found if i not in ids]
    return ids, dropped


def load_scripts(path: Path, limit_conversations: int | None = None, limit_sessions: int | None = None,
                 limit_questions: int | None = None) -> list[Script]:
    """The conversations as requests and questions. With `limit_sessions`, only the first sessions
    are told, and only questions whose evidence all lies in them are asked."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    scripts: list[Script] = []
    for item in raw[:limit_conversations]:
        conv = item["conversation"]
        a, b = conv["speaker_a"], conv["speaker_b"]
        numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))[:limit_sessions]
        exchanges: list[Exchange] = []
        told: set[str] = set()
        opened_by_b = 0
        for n in numbers:
            runs: list[tuple[str, list[str]]] = []  # one speaker's consecutive turns
            for turn in conv[f"session_{n}"]:
                told.add(turn["dia_id"])
                if runs and runs[-1][0] == turn["speaker"]:
                    runs[-1][1].append(turn_text(turn))
                else:
                    runs.append((turn["speaker"], [turn_text(turn)]))
            opened_by_b += bool(runs) and runs[0][0] != a
            pending: list[str] = []
            for i, (speaker, lines) in enumerate(runs):
                if speaker == a or i == 0:
                    pending.append("\n".join(lines))
                else:
                    exchanges.append(Exchange(pending, "\n".join(lines)))
                    pending = []
            if pending:
                exchanges.append(Exchange(pending, NO_REPLY))
        questions: list[Question] = []
        dropped = 0
        for qa in item.get("qa", []):
            ids, lost = evidence_ids(qa.get("evidence") or [])
            dropped += lost
            if ids and all(i in told for i in ids):
                questions.append(Question(str(qa["question"]), str(qa.get("category", "?")), ids))
        scripts.append(Script(item.get("sample_id", f"conv-{len(scripts)}"), SYSTEM_TEMPLATE.format(a=a, b=b),
                              exchanges, questions[:limit_questions], len(numbers), opened_by_b, dropped))
    return scripts


def replies(scripts: Sequence[Script]) -> tuple[dict[str, str], int]:
    """The fake upstream's script, {sha256(last user message): reply}, and how many last messages
    were scripted twice with different replies (each such request would get a wrong answer)."""
    out: dict[str, str] = {}
    clashes = 0
    for script in scripts:
        for exchange in script.exchanges:
            key = digest(exchange.messages[-1])
            clashes += key in out and out[key] != exchange.reply
            out[key] = exchange.reply
    return out, clashes


@dataclass
class ReplayCount:
    requests: int = 0
    overflows: int = 0  # 400 context_length_exceeded
    errors: dict[str, int] = field(default_factory=dict)  # any other refusal, by status
    recalled: list[int] = field(default_factory=list)  # X-Memproxy-Recalled, where memproxy sends it
    context_tokens: list[int] = field(default_factory=list)


async def _refusal(response: aiohttp.ClientResponse) -> str:
    """`context_length_exceeded` or `HTTP <status>`."""
    try:
        body = await response.json(content_type=None)
        code = body.get("error", {}).get("code")
    except (ValueError, AttributeError, aiohttp.ContentTypeError):
        code = None
    return "context_length_exceeded" if code == "context_length_exceeded" else f"HTTP {response.status}"


async def tell(session: aiohttp.ClientSession, base: str, headers: dict[str, str], model: str,
               session_id: str, script: Script) -> ReplayCount:
    """Every exchange of `script`, in order, as a client sending only its new messages."""
    count = ReplayCount()
    system = {"role": "system", "content": script.system}
    for exchange in script.exchanges:
        body = {"model": model, "messages": [system, *({"role": "user", "content": m} for m in exchange.messages)]}
        async with session.post(f"{base}/v1/chat/completions", json=body, headers={
            **headers, "X-Session-Id": session_id, "X-Memproxy-History": "new",
        }) as response:
            count.requests += 1
            if response.status != 200:
                kind = await _refusal(response)
                if kind == "context_length_exceeded":
                    count.overflows += 1
                else:
                    count.errors[kind] = count.errors.get(kind, 0) + 1
                continue
            await response.read()
            recalled = leading_int(response.headers.get("X-Memproxy-Recalled"))
            if recalled is not None:
                count.recalled.append(recalled)
            count.context_tokens.append(int(response.headers.get("X-Memproxy-Context-Tokens", "0")))
    return count


def found_tags(messages: Sequence[dict[str, Any]]) -> set[str]:
    """Every dia id tagged in the messages' text, whatever the content's shape."""
    found: set[str] = set()
    for message in messages:
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                found.update(TAG.findall(text))
    return found


async def ask(session: aiohttp.ClientSession, base: str, headers: dict[str, str], model: str,
              session_id: str, script: Script) -> tuple[Score, int]:
    """Every question of `script` as the session's next turn, through the context endpoint; the
    score by category and how many were refused for overflow."""
    score, overflows = Score(), 0
    system = {"role": "system", "content": script.system}
    for question in script.questions:
        body = {"model": model, "messages": [system, {"role": "user", "content": question.text}]}
        async with session.post(f"{base}/v1/sessions/{session_id}/context", json=body, headers=headers) as response:
            if response.status != 200:
                kind = await _refusal(response)
                overflows += kind == "context_length_exceeded"
                score.error(kind)
                continue
            preview = await response.json()
        found = found_tags(preview["messages"])
        score.add(question.category, sum(i in found for i in question.evidence) / len(question.evidence))
    return score, overflows
