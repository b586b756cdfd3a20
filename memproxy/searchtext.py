"""The words of a stored message, as the store indexes them and recall and search look them up.

One analysis for both sides: `message_words` is what the store indexes for a message (the text of
its content parts, its tool calls' names and arguments, a tool result, and the date it was stored),
`query_words` what a question is looked up by (its words, lower-cased, without the function words
that match nearly everything). Each backend stems both the same way (SQLite FTS5's `porter`
tokenizer, PostgreSQL's `english` configuration), so "running" finds "runs".
"""

from __future__ import annotations

import hashlib
import re
import time
import unicodedata
from collections.abc import Sequence
from typing import Any

from .messages import Message, audio_transcript, called

# The most characters of a message's text indexed: a tool output of megabytes is found by its start.
MAX_INDEXED_CHARS = 32_000
# The most words a question is looked up by: the later ones of a long message add little.
MAX_QUERY_WORDS = 24
# Scripts written without spaces between words: Han (Chinese characters, Japanese kanji), kana,
# Hangul (whose spaces separate phrases of a word and its particles), Thai, Lao, Burmese and Khmer.
# A run of them is indexed and looked up as its overlapping pairs of characters ("长城很好" as 长城,
# 城很, 很好), as Lucene's CJK analyzer does: without a dictionary, the pairs find a word of two
# characters or more inside any run that holds it, where the whole run as one word found only the
# same sentence again.
UNSPACED = ("\u0e00-\u0eff\u1000-\u109f\u1100-\u11ff\u1780-\u17ff\u3005\u3040-\u30ff\u3130-\u318f"
            "\u3400-\u4dbf\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f"
            "\U00020000-\U0003134f")


def _ranges(codes: list[int]) -> str:
    """Ascending code points as a regular expression's character ranges."""
    spans: list[list[int]] = []
    for c in codes:
        if spans and spans[-1][1] == c - 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return "".join(chr(lo) if lo == hi else f"{chr(lo)}-{chr(hi)}" for lo, hi in spans)


# Combining marks (vowel signs, tone marks, vowel points, a decomposed accent) are left out of every
# word and run, in a message and in a question alike: a run of letters (`_WORD`) broke a word at
# each ("दिल्ली" was द, ल, ल), SQLite's FTS5 tokenizer splits a word at each too, and most text
# omits Hebrew's and Arabic's vowel points anyway ("दिल्ली" as दलल, "กรุงเทพ" as กร, รง, งเ, เท,
# ทพ, "مَرْحَبًا" as مرحبا; a Latin accent the stores fold away themselves). Words that differ only
# by their marks are then one word: a question finds both. These are every combining mark of the
# Basic Multilingual Plane (1,336 in Python 3.11's Unicode 14).
MARKS = _ranges([c for c in range(0x0300, 0x10000) if unicodedata.category(chr(c))[0] == "M"])
_MARKS = re.compile(f"[{MARKS}]")
# A store may put the session's key before each word (`key_word`): `_` cannot be part of a word.
_WORD = re.compile(r"[^\W_]+")  # text with neither those scripts nor combining marks (most text)
_WORD_OR_UNSPACED = re.compile(  # a run of those scripts (group 1), or a word; their marks in them
    f"([{UNSPACED}][{UNSPACED}{MARKS}]*)|[^\\W_{UNSPACED}{MARKS}][^\\W_{UNSPACED}]*(?:[{MARKS}]+[^\\W_{UNSPACED}]*)*")
_SPECIAL = re.compile(f"[{UNSPACED}{MARKS}]")
_UNSPACED_CHAR = re.compile(f"[{UNSPACED}]")
# The longest word indexed or looked up. PostgreSQL refuses a lexeme of 2,048 bytes or more (a
# whole message's write would fail on one long hex token or 700 Devanagari letters without a break),
# and a run of letters that long (a key, a hash, base64) is nothing anyone searches by.
MAX_WORD_CHARS = 200

# English function words: they match nearly every message and rank nothing. A generic list (the
# common core of the usual stop lists), not one built from any data set's questions.
STOPWORDS = frozenset("""
a about above after again against all am an and any are aren as at be because been before being
below between both but by can cannot could couldn did didn do does doesn doing don down during each
few for from further had hadn has hasn have haven having he her here hers herself him himself his
how i if in into is isn it its itself just let ll me more most my myself no nor not now of off on
once only or other ought our ours ourselves out over own re s same shan she should shouldn so some
such t than that the their theirs them themselves then there these they this those through to too
under until up ve very was wasn we were weren what when where which while who whom why will with
won would wouldn you your yours yourself yourselves d m o y ok okay oh yeah yes hey hi hello also
really get got go going gonna thing things one
""".split())


def _texts(value: Any, out: list[str]) -> None:
    """Every string in a message's content, parts or tool calls, in order."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _texts(item, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in ("type", "id", "tool_call_id", "image_url", "input_audio", "file"):
                _texts(item, out)


def message_text(body: Message) -> str:
    """A message's searchable text: content, refusal, what it said aloud (an audio answer's
    transcript), tool calls (names and arguments) and name."""
    out: list[str] = []
    for key in ("name", "content", "refusal", "tool_calls", "function_call"):
        _texts(body.get(key), out)
    _texts(audio_transcript(body), out)
    return " ".join(out)[:MAX_INDEXED_CHARS]


_PART_NAMES = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file",
               "input_file": "file"}  # a part recall shows as its kind alone


def line_text(body: Message) -> str:
    """A stored message as recall shows it, on one line (`memproxy.memory.recall`): its text parts,
    a tool result's output, `[image]` and the like for parts of other kinds, what it said aloud
    (an audio answer's transcript) or refused, and what it calls, each
    run of whitespace one space. One line a message: a stored text cannot start a line of the block
    of its own, so it cannot pose as another recalled message (`[#12 system] ...`) or as the end
    of the block."""
    content = body.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                kind = str(part.get("type"))
                text = part.get("text") if kind in ("text", "input_text", "output_text") else None
                if kind == "refusal" and isinstance(part.get("refusal"), str):
                    text = f"[refused] {part['refusal']}"
                parts.append(str(text) if text is not None else f"[{_PART_NAMES.get(kind, 'part')}]")
    spoken, refusal = audio_transcript(body), body.get("refusal")
    if spoken is not None:
        parts.append(spoken)
    if isinstance(refusal, str):
        parts.append(f"[refused] {refusal}")
    calls = body.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            name, given = called(call)  # a function's name and arguments, or a custom tool's name and input
            if name is not None:
                parts.append(f"[calls {name}({given})]")
    return " ".join(word for part in parts for word in part.split())


def recall_line(body: Message) -> str:
    """A message's text as a line of a recall block holds it after its label: its tokens are
    counted once, when it is stored (`NewMessage.recall_tokens`), and summed with the labels'
    (`memproxy.memory.recall.render` says why the sum is exact)."""
    return f" {line_text(body)}\n"


def date_words(created_at: float) -> str:
    """The date a message was stored, as words a question may use ("2026 11 24 November Tuesday")."""
    return time.strftime("%Y %m %d %B %A", time.gmtime(created_at))


def message_words(body: Message, created_at: float) -> list[str]:
    """The words a stored message is indexed by, lower-cased, in order, its date's last."""
    words = words_of(f"{message_text(body)} {date_words(created_at)}")
    return [w for w in words if len(w) <= MAX_WORD_CHARS]


def session_key(tenant: str, session_id: str) -> str:
    """The key a session's words are indexed under: 12 digits from a hash of its tenant and id.
    Digits, so that a stemmer sees `key_word` as it sees `word`; a clash between two sessions only
    shares their index's statistics, never their messages (each lookup names its sessions too)."""
    digest = hashlib.blake2b(f"{tenant}\x00{session_id}".encode("utf-8", "surrogatepass"), digest_size=8)
    return str(int.from_bytes(digest.digest(), "big") % 10**12).zfill(12)


def keyed(key: str, words: list[str]) -> str:
    """Words as a session's index holds them and a lookup names them: `key_word key_word ...`."""
    return " ".join(f"{key}_{word}" for word in words)


def words_of(text: str) -> list[str]:
    """A text's words, lower-cased, in order: runs of letters and digits, each run of a script
    written without spaces (`UNSPACED`) as its overlapping pairs of characters (one character alone
    as itself), where it meets a letter of another script too ("iPhone手机" is iphone, 手机); its
    combining marks left out (`MARKS`)."""
    text = text.lower()
    if text.isascii() or not _SPECIAL.search(text):  # most text: one pass, as fast as before
        return _WORD.findall(text)
    words: list[str] = []
    for match in _WORD_OR_UNSPACED.finditer(text):
        run = match.group(1)
        if run is None:
            word = _MARKS.sub("", match.group())
            if word:
                words.append(word)
            continue
        run = _MARKS.sub("", run)
        if run:
            words += [run] if len(run) < 3 else [run[i : i + 2] for i in range(len(run) - 1)]
    return words


def query_words(text: str) -> list[str]:
    """The distinct words a question is looked up by, in order, without function words."""
    seen: dict[str, None] = {}
    for word in words_of(text):
        if (word not in STOPWORDS and (len(word) > 1 or word.isdigit() or _UNSPACED_CHAR.match(word))
                and len(word) <= MAX_WORD_CHARS):
            seen.setdefault(word, None)
    return list(seen)[:MAX_QUERY_WORDS]


def matched_words(words: Sequence[str], body: Message, created_at: float) -> list[str]:
    """The query's words a message holds, as its index holds them (its text, and the words of the
    date it was stored at), compared without the common English endings the stores' stemmers also
    ignore ("visited" finds "visit")."""
    held = {_stem(w) for w in message_words(body, created_at)}
    return [w for w in words if _stem(w) in held]


def _stem(word: str) -> str:
    for ending in ("ing", "ed", "es", "ly", "s"):
        if word.endswith(ending) and len(word) - len(ending) >= 3:
            return word[: -len(ending)]
    return word
