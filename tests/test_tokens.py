"""Exact token counting (issue item 7): OpenAI's accounting, tool calls and schemas, offline
tokenizers, and counts computed once per stored message."""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import memproxy
from conftest import Proxy
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config
from memproxy.messages import Message
from memproxy.provider import LitellmCounter, load_litellm
from memproxy.tokens import (HOISTED_IMAGES_BOUNDARY, HOISTED_IMAGES_PLACEHOLDER, TOKENS_PER_AUDIO_SECOND,
                             TOKENS_PER_DOCUMENT_PAGE, TOKENS_PER_IMAGE, TiktokenCounter, answer_audio_tokens,
                             attachment_tokens, encoding_name_for, request_tokens)
from memproxy.typedefs import PROVIDER
from test_budget import TOOLS, db_path, tool_call, words

ENCODINGS = ("cl100k_base", "o200k_base")

# The example of OpenAI's cookbook "How to count tokens with tiktoken", whose counts the cookbook
# checked against the API's usage.prompt_tokens: 129 for gpt-3.5/gpt-4, 124 for gpt-4o.
COOKBOOK_MESSAGES: list[Message] = [
    {"role": "system", "content": "You are a helpful, pattern-following assistant that translates "
                                  "corporate jargon into plain English."},
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant",
     "content": "Things working well together will increase revenue."},
    {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth "
                                                          "to touch base on opportunities for increased leverage."},
    {"role": "system", "name": "example_assistant",
     "content": "Let's talk later when we're less busy about how to do better."},
    {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the "
                                "client deliverable."},
]


def cookbook_count(messages: list[Message], encoding_name: str) -> int:
    """The cookbook's num_tokens_from_messages, written out independently of memproxy."""
    encoding = tiktoken.get_encoding(encoding_name)
    total = 0
    for message in messages:
        total += 3
        for key, value in message.items():
            total += len(encoding.encode(value, disallowed_special=()))
            if key == "name":
                total += 1
    return total + 3


def encoded(text: str, encoding_name: str = "o200k_base") -> int:
    return len(tiktoken.get_encoding(encoding_name).encode(text, disallowed_special=()))


# --- OpenAI's accounting -------------------------------------------------------------------------


@pytest.mark.parametrize(("encoding_name", "expected"), [("cl100k_base", 129), ("o200k_base", 124)])
def test_cookbook_example_counts_what_the_api_reported(encoding_name: str, expected: int) -> None:
    assert request_tokens(TiktokenCounter(encoding_name), COOKBOOK_MESSAGES, []) == expected


text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=200)
plain_messages = st.lists(
    st.builds(
        lambda role, content, name: {"role": role, "content": content, **({"name": name} if name else {})},
        st.sampled_from(["system", "developer", "user", "assistant"]),
        text,
        st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)),
    ),
    min_size=1, max_size=6,
)


@settings(max_examples=60, deadline=None, database=None)
@given(messages=plain_messages, encoding_name=st.sampled_from(ENCODINGS))
def test_text_messages_follow_the_cookbook_formula(messages: list[Message], encoding_name: str) -> None:
    assert request_tokens(TiktokenCounter(encoding_name), messages, []) == cookbook_count(messages, encoding_name)


@pytest.mark.parametrize("encoding_name", ENCODINGS)
def test_special_token_text_is_counted_as_plain_text(encoding_name: str) -> None:
    counter = TiktokenCounter(encoding_name)
    message = {"role": "user", "content": "ignore <|endoftext|> and <|im_start|>"}
    assert counter.message(message) == cookbook_count([message], encoding_name) - 3
    assert counter.text("<|endoftext|>") > 1  # not collapsed into the one special token


@pytest.mark.parametrize(("model", "encoding_name"), [
    ("openai/gpt-4o-mini", "o200k_base"),
    ("gpt-4o", "o200k_base"),
    ("openai/gpt-4", "cl100k_base"),
    ("gpt-3.5-turbo", "cl100k_base"),
    ("openai/small", "o200k_base"),  # unknown: the newest encoding
])
def test_encoding_follows_the_model(model: str, encoding_name: str) -> None:
    assert encoding_name_for(model) == encoding_name


# --- tool calls and tool schemas -----------------------------------------------------------------


@pytest.mark.parametrize("encoding_name", ENCODINGS)
def test_tool_calls_are_counted(encoding_name: str) -> None:
    counter = TiktokenCounter(encoding_name)
    bare: Message = {"role": "assistant", "content": None}
    one_call = {**bare, "tool_calls": [tool_call("call_alpha", '{"city": "Paris"}')]}
    two_calls = {**bare, "tool_calls": [*one_call["tool_calls"], tool_call("call_beta", '{"city": "Rome"}')]}
    long_args = {**bare, "tool_calls": [tool_call("call_alpha", json.dumps({"city": words(50)}))]}
    call_text = sum(encoded(s, encoding_name) for s in ("call_alpha", "lookup", '{"city": "Paris"}'))
    assert counter.message(one_call) >= counter.message(bare) + call_text
    assert counter.message(two_calls) > counter.message(one_call)
    added = encoded(json.dumps({"city": words(50)}), encoding_name) - encoded('{"city": "Paris"}', encoding_name)
    assert counter.message(long_args) - counter.message(one_call) >= added - 2


@pytest.mark.parametrize("encoding_name", ENCODINGS)
def test_tool_results_count_their_call_id(encoding_name: str) -> None:
    counter = TiktokenCounter(encoding_name)
    result = {"role": "tool", "tool_call_id": "call_alpha", "content": "18 degrees"}
    assert counter.message(result) == cookbook_count([result], encoding_name) - 3


@pytest.mark.parametrize("encoding_name", ENCODINGS)
def test_tool_schemas_are_counted(encoding_name: str) -> None:
    counter = TiktokenCounter(encoding_name)
    messages = [{"role": "user", "content": "weather?"}]
    function = TOOLS[0]["function"]
    described = [{**TOOLS[0], "function": {**function, "description": words(80)}}]
    second = {**TOOLS[0], "function": {**function, "name": "forecast"}}
    without = request_tokens(counter, messages, [])
    assert counter.tools([]) == 0
    assert request_tokens(counter, messages, TOOLS) - without >= sum(
        encoded(s, encoding_name) for s in (function["name"], function["description"], "q", "string"))
    assert counter.tools(TOOLS + [second]) > counter.tools(TOOLS)
    assert counter.tools(described) - counter.tools(TOOLS) >= (
        encoded(words(80), encoding_name) - encoded(function["description"], encoding_name))


# --- offline tokenizers --------------------------------------------------------------------------

_OFFLINE_COUNT = """
import json, sys
{first}
from memproxy.tokens import TiktokenCounter, request_tokens
message = {{"role": "user", "content": "hello offline world", "name": "ann"}}
counts = {{e: request_tokens(TiktokenCounter(e), [message], []) for e in ("cl100k_base", "o200k_base")}}
print(json.dumps({{"counts": counts, "litellm": "litellm" in sys.modules}}))
"""


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """No tiktoken cache, an empty HOME and temp dir, and every download sent to a dead proxy."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "NO_PROXY", "no_proxy")}
    for name in ("home", "tmp", "cache"):
        (tmp_path / name).mkdir()
    dead = "http://127.0.0.1:9"
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               HTTPS_PROXY=dead, HTTP_PROXY=dead, https_proxy=dead, http_proxy=dead,
               LITELLM_LOCAL_MODEL_COST_MAP="True",
               PYTHONPATH=str(Path(memproxy.__file__).parent.parent))  # the memproxy under test
    return env


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("first", ["", "import litellm"], ids=["memproxy-alone", "litellm-first"])
def test_tokenizers_load_offline_whatever_is_imported_first(tmp_path: Path, first: str) -> None:
    env = _offline_env(tmp_path)
    # The environment really is offline: plain tiktoken cannot get its encoding.
    control = _run("import tiktoken; tiktoken.get_encoding('o200k_base')", env, tmp_path)
    assert control.returncode != 0 and "127.0.0.1" in control.stderr
    result = _run(_OFFLINE_COUNT.format(first=first), env, tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    message = {"role": "user", "content": "hello offline world", "name": "ann"}
    assert report["counts"] == {e: cookbook_count([message], e) for e in ENCODINGS}
    assert report["litellm"] is bool(first)
    assert not any((tmp_path / "tmp").iterdir()) and not any((tmp_path / "cache").iterdir())


# --- litellm's counter, for providers tiktoken does not know --------------------------------------


def test_litellm_counter_agrees_with_litellm() -> None:
    litellm = load_litellm()
    model = "anthropic/claude-3-5-sonnet-20240620"
    counter = LitellmCounter(litellm, model)
    messages: list[Message] = [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": words(40), "name": "ann"},
                               {"role": "assistant", "content": words(20, 3)}]
    assert request_tokens(counter, messages, []) == litellm.token_counter(model=model, messages=messages)
    assert counter.tools(TOOLS) > 0


def test_an_image_url_is_counted_never_fetched() -> None:
    """litellm's counter sizes a high-detail image by downloading it: a host a client names, looked
    up and fetched on the event loop (every other request waits), and a URL it cannot fetch raised
    a 500. Images count as tiktoken's counter counts them, whatever the URL."""
    counter = LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")
    text: Message = {"role": "user", "content": [{"type": "text", "text": "What is in it?"}]}
    for url in ("http://memproxy-test.invalid/cat.png", "not-a-url", "http://127.0.0.1:1/x.png"):
        for kind in ("image_url", "input_image"):
            part = {"type": kind, kind: {"url": url, "detail": "high"}} if kind == "image_url" \
                else {"type": kind, "image_url": url, "detail": "high"}
            image: Message = {"role": "user", "content": [*text["content"], part]}
            assert counter.message(image) == counter.message(text) + TOKENS_PER_IMAGE


def test_parts_litellm_cannot_count_are_counted_as_their_json() -> None:
    """litellm's counter raises on a part it does not know (a file by id, a refusal, a Responses
    `input_text`, anything new): those requests were a 500 before anything was sent. Such a part
    counts as its JSON, as tiktoken's counter counts it."""
    counter = LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")
    text: Message = {"role": "user", "content": [{"type": "text", "text": "What is in it?"}]}
    for part in ({"type": "file", "file": {"file_id": "file-abc"}}, {"type": "refusal", "refusal": "I can't"},
                 {"type": "input_text", "text": "hello there"}, {"type": "some_new_part", "data": [1, 2]}):
        with_part: Message = {"role": "user", "content": [*text["content"], part]}
        assert counter.message(with_part) == counter.message(text) + counter.text(json.dumps(part, separators=(",", ":")))


# --- counted once, stored with the message -------------------------------------------------------


def _stored(path: str) -> list[tuple[Message, int, int, int]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT body, tokens, cum_before, unit_start FROM messages WHERE active = 1"
                          " ORDER BY session_pk, seq").fetchall()
    return [(json.loads(body), tokens, cum, unit) for body, tokens, cum, unit in rows]


async def test_stored_counts_are_the_counters_and_add_up(proxy: Proxy, upstream: FakeUpstream) -> None:
    counter = TiktokenCounter(encoding_name_for("openai/small"))
    client = proxy.client(session="stored-counts")
    calls = [tool_call("call_1", '{"q": "fjords"}'), tool_call("call_2", '{"q": "数据"}')]
    upstream.enqueue(Reply(tool_calls=calls), Reply(content="done"), Reply(tool_calls=[tool_call("call_3")]))
    await client.chat.completions.create(model="small", tools=TOOLS,  # type: ignore[arg-type]
                                         messages=[{"role": "system", "content": "sys"},
                                                   {"role": "user", "content": words(30), "name": "ann"}])
    await client.chat.completions.create(model="small", tools=TOOLS, messages=[  # type: ignore[arg-type]
        {"role": "tool", "tool_call_id": c["id"], "content": f"result {words(10, i)}"} for i, c in enumerate(calls)])
    stream = await client.chat.completions.create(model="small", tools=TOOLS, stream=True,  # type: ignore[arg-type]
                                                  messages=[{"role": "user", "content": "again 🙂"}])
    async for _ in stream:
        pass
    stored = _stored(db_path(proxy))
    assert [m["role"] for m, *_ in stored] == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert stored[-1][0]["tool_calls"][0]["id"] == "call_3"  # assembled from the stream
    running = 0
    for body, tokens, cum_before, unit_start in stored:
        assert tokens == counter.message(body)
        assert cum_before == running
        assert unit_start == (body["role"] != "tool")
        running += tokens
    with contextlib.closing(sqlite3.connect(db_path(proxy))) as db:
        assert db.execute("SELECT head_cum, length FROM sessions").fetchone() == (running, len(stored))


class CountingCounter(TiktokenCounter):
    """The real counter, remembering every message it is asked to count."""

    def __init__(self, encoding_name: str) -> None:
        super().__init__(encoding_name)
        self.counted: list[Message] = []

    def message(self, message: Message) -> int:
        self.counted.append(message)
        return super().message(message)


def _install_counting_counter(proxy: Proxy) -> CountingCounter:
    counting = CountingCounter(encoding_name_for("openai/small"))
    # The provider builds one counter per model at start; this swaps in the counting one.
    proxy.app[PROVIDER]._counters["small"] = counting
    return counting


@pytest.mark.parametrize("style", ["full", "new"])
async def test_building_a_request_never_retokenizes_stored_history(
    start_proxy: Any, config: Config, upstream: FakeUpstream, style: str
) -> None:
    system = {"role": "system", "content": "sys"}
    history: list[Message] = []
    for restart in range(2):  # counts survive a restart: they are stored, not cached
        proxy = await start_proxy(config)
        counting = _install_counting_counter(proxy)
        client = proxy.client(session="once")
        for turn in range(6):
            user = {"role": "user", "content": f"turn {restart}.{turn} {words(150, turn)}"}
            counting.counted.clear()
            raw = await client.chat.completions.with_raw_response.create(
                model="small", messages=[system, *(history if style == "full" else []), user])
            reply = {"role": "assistant", "content": raw.parse().choices[0].message.content}
            # Only what is new this turn: the message, the system prompt sent with it, the reply.
            assert sorted(map(json.dumps, counting.counted)) == sorted(map(json.dumps, [system, user, reply]))
            assert not any(m in history for m in counting.counted)
            history += [user, reply]
    assert int(raw.headers["x-memproxy-stored-omitted"]) > 0  # the cut was searched for, too
    assert upstream.last().messages[-1] == user


# --- audio and documents: estimated as providers bill them, not as base64 text ---------------------


def wav(seconds: float, rate: int = 16_000) -> str:
    """A mono 16-bit WAV clip of noise (as incompressible as speech), base64."""
    data = os.urandom(int(seconds * rate) * 2)
    header = (b"RIFF" + (36 + len(data)).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
              + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + rate.to_bytes(4, "little")
              + (rate * 2).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
              + b"data" + len(data).to_bytes(4, "little"))
    return base64.b64encode(header + data).decode()


def pdf(pages: int) -> str:
    """A data URL of a PDF with `pages` page objects (and the page tree, which is not a page), and a
    compressed stream of 40 KB."""
    stream = b"9 0 obj << /Length 40000 /Filter /FlateDecode >> stream\n" + os.urandom(40_000) + b"\nendstream endobj"
    objects = [b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj", stream,
               b"2 0 obj << /Type /Pages /Count %d >> endobj" % pages]
    objects += [b"%d 0 obj << /Type /Page /Parent 2 0 R >> endobj" % (3 + i) for i in range(pages)]
    return "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4\n" + b"\n".join(objects) + b"\n%%EOF").decode()


def audio_part(data: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def file_part(data: str) -> dict[str, Any]:
    return {"type": "file", "file": {"filename": "report.pdf", "file_data": data}}


def picture(width: int, height: int, kind: str = "PNG", **options: Any) -> str:
    """A real image of that size as a data URL."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, kind, **options)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "GIF", "WEBP"])
def test_an_inline_image_costs_what_its_size_does(kind: str) -> None:
    """OpenAI's tiles by the image's size (fitted into 2048 px, its short side cut to 768, 170 a
    512 px tile and 85), not a flat 765: a 1280x800 screenshot is six tiles (1,105 tokens), and a
    computer-use agent sending a screenshot a step was counted hundreds of tokens short each."""
    # Fitted into 2048 px first (3000x1000: 2048x683, eight tiles; cut to 768 first, ten), the short
    # side cut to 768 (1280x800: 1229x768, six), never grown (100x100: one).
    for (width, height), tiles in (((1280, 800), 6), ((100, 100), 1), ((3000, 1000), 8), ((768, 2000), 8),
                                   ((700, 1100), 6)):
        url = picture(width, height, kind)
        high = {"type": "image_url", "image_url": {"url": url, "detail": "high"}}
        assert attachment_tokens(high) == 85 + 170 * tiles
        assert attachment_tokens({"type": "image_url", "image_url": {"url": url}}) == 85 + 170 * tiles  # auto
        assert attachment_tokens({"type": "input_image", "image_url": url, "detail": "auto"}) == 85 + 170 * tiles
        # `detail: low` is 85 at OpenAI, but a model behind an OpenAI-compatible server may not read
        # it: never more than an image of unknown size, never more than its tiles.
        low = attachment_tokens({"type": "image_url", "image_url": {"url": url, "detail": "low"}})
        assert low == min(85 + 170 * tiles, TOKENS_PER_IMAGE)
    # For another provider's model the most of OpenAI's count and Anthropic's (area / 750, at most
    # about 1,600), whatever the detail: Anthropic reads none.
    screenshot = {"type": "image_url", "image_url": {"url": picture(1280, 800, kind), "detail": "low"}}
    assert attachment_tokens(screenshot, openai=False) == math.ceil(1280 * 800 / 750)
    assert attachment_tokens({"type": "image_url", "image_url": {"url": picture(768, 2000, kind)}}, openai=False) \
        == 85 + 170 * 8


def test_an_image_is_sized_however_its_base64_is_written() -> None:
    """Wrapped at 76 characters (`base64.encodebytes`, GNU `base64`), URL-safe, `;BASE64,`: the same
    image, past the first 256 KiB too (a picture of noise does not compress)."""
    out = io.BytesIO()
    Image.effect_noise((1280, 800), 64).convert("RGB").save(out, "PNG")
    raw = out.getvalue()
    assert len(raw) > 2 * 256 * 1024
    for url in ("data:image/png;base64," + base64.encodebytes(raw).decode(),
                "data:image/png;base64," + base64.urlsafe_b64encode(raw).decode(),
                "data:image/png;BASE64," + base64.b64encode(raw).decode()):
        assert attachment_tokens({"type": "image_url", "image_url": {"url": url}}) == 85 + 170 * 6


def test_an_image_of_unknown_size_costs_a_photo() -> None:
    """A URL is never fetched to be sized, and data no reader knows is not an image's size: both
    count `TOKENS_PER_IMAGE`. A JPEG whose metadata runs long is still sized from its header."""
    assert attachment_tokens({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}) == TOKENS_PER_IMAGE
    for junk in ("data:image/png;base64,AAAA", "data:image/png;base64,not base64!",
                 "data:image/png;base64," + base64.b64encode(os.urandom(3000)).decode(), "data:image/png,raw"):
        assert attachment_tokens({"type": "image_url", "image_url": {"url": junk}}) == TOKENS_PER_IMAGE
    exif = Image.Exif()
    exif[0x010E] = "x" * 60_000  # an image description: one long metadata segment before the frame
    url = picture(1280, 800, "JPEG", exif=exif.tobytes(), comment=b"y" * 60_000)
    assert len(url) > 160_000 and attachment_tokens({"type": "image_url", "image_url": {"url": url}}) == 85 + 170 * 6


def test_both_counters_count_an_inline_image_by_its_size() -> None:
    text: Message = {"role": "user", "content": [{"type": "text", "text": "What is in it?"}]}
    image: Message = {"role": "user", "content": [*text["content"], {"type": "image_url", "image_url": {
        "url": picture(1280, 800)}}]}
    tiktoken_counter = TiktokenCounter("o200k_base")
    assert tiktoken_counter.message(image) == tiktoken_counter.message(text) + 85 + 170 * 6
    claude = LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")
    assert claude.message(image) == claude.message(text) + math.ceil(1280 * 800 / 750)


def test_audio_and_documents_cost_their_length_not_their_bytes() -> None:
    assert attachment_tokens(audio_part(wav(10))) == 10 * TOKENS_PER_AUDIO_SECOND  # the header's byte rate
    assert attachment_tokens(audio_part(wav(10, rate=48_000))) == 10 * TOKENS_PER_AUDIO_SECOND
    # No header (an mp3): a duration at 32 kbit/s, longer than any real clip of that size.
    assert attachment_tokens(audio_part(base64.b64encode(os.urandom(40_000)).decode())) == 10 * TOKENS_PER_AUDIO_SECOND
    # A header alone, or a crafted byte rate on one: never below nothing (a negative count let a
    # request past the window's check, and its refusal raised the model's calibration for all).
    header_only = base64.b64decode(wav(0))[:33]
    crafted = header_only[:28] + (1).to_bytes(4, "little") + header_only[32:]
    assert attachment_tokens(audio_part(base64.b64encode(crafted).decode())) == 0
    assert attachment_tokens(audio_part(base64.b64encode(header_only).decode())) == 0
    assert attachment_tokens(file_part(pdf(3))) == 3 * TOKENS_PER_DOCUMENT_PAGE
    # Pages in compressed streams: counted from the size, a page per 50 KB.
    assert attachment_tokens(file_part(base64.b64encode(os.urandom(200_000)).decode())) == 4 * TOKENS_PER_DOCUMENT_PAGE
    assert attachment_tokens({"type": "input_file", "file_data": pdf(2)}) == 2 * TOKENS_PER_DOCUMENT_PAGE
    assert attachment_tokens({"type": "file", "file": {"file_id": "file-abc"}}) is None  # the provider knows its size
    assert attachment_tokens({"type": "text", "text": "hi"}) is None

    message: Message = {"role": "user", "content": [{"type": "text", "text": "What is said?"}, audio_part(wav(10))]}
    text_only: Message = {"role": "user", "content": [{"type": "text", "text": "What is said?"}]}
    for counter in (TiktokenCounter("o200k_base"), LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")):
        assert counter.message(message) == counter.message(text_only) + 10 * TOKENS_PER_AUDIO_SECOND
        document: Message = {"role": "user", "content": [file_part(pdf(5))]}
        assert counter.message(document) >= 5 * TOKENS_PER_DOCUMENT_PAGE


def test_thinking_blocks_count_with_litellms_counter_too() -> None:
    """Anthropic's thinking blocks go back upstream inside an unfinished tool exchange, and are read
    as input; litellm's counter passed them over (a 300-word thought counted as nothing)."""
    counter = LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")
    blocks = [{"type": "thinking", "thinking": words(300), "signature": "sig"}]
    plain: Message = {"role": "assistant", "content": None, "tool_calls": [tool_call("c1", "f")]}
    thought: Message = {**plain, "thinking_blocks": blocks}
    assert counter.message(thought) == counter.message(plain) + counter.text(
        json.dumps(blocks, separators=(",", ":"), ensure_ascii=False))
    assert counter.message(thought) > counter.message(plain) + 300


def test_a_spoken_answer_counts_as_heard_not_as_its_base64() -> None:
    """An audio answer is stored with its clip, but only its id goes back upstream, and the model
    hears the clip again: it counts by its duration, as an input clip does, not as 40,000 characters
    of base64 (which left the previous exchange out, and refused a tool result after it)."""
    clip = wav(10)
    spoken: Message = {"role": "assistant", "content": None,
                       "audio": {"id": "audio_abc", "data": clip, "expires_at": 1, "transcript": "Hello there."}}
    silent: Message = {"role": "assistant", "content": None}
    for counter in (TiktokenCounter("o200k_base"), LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")):
        assert counter.message(spoken) == counter.message(silent) + 10 * TOKENS_PER_AUDIO_SECOND + counter.text("audio_abc")
    # A streamed answer's clip is OpenAI's `pcm16` (streaming takes no other format): raw samples
    # at 24 kHz, no header. Counted at a compressed clip's bit rate, ten seconds read as two minutes.
    pcm16 = base64.b64encode(bytes(2) + os.urandom(10 * 48_000 - 2)).decode()
    streamed: Message = {**spoken, "audio": {**spoken["audio"], "data": pcm16}}
    for counter in (TiktokenCounter("o200k_base"), LitellmCounter(load_litellm(), "anthropic/claude-3-5-sonnet-20240620")):
        assert counter.message(streamed) == counter.message(spoken)
    # An mp3 answer (its frames' sync, no tag) is still counted at the low bit rate, erring long.
    mp3 = base64.b64encode(b"\xff\xfb" + os.urandom(39_998)).decode()
    assert answer_audio_tokens({**spoken, "audio": {"id": "audio_abc", "data": mp3}}) == 10 * TOKENS_PER_AUDIO_SECOND
    # By its id alone (a client resending history): its JSON, as any other field.
    tiktoken_counter = TiktokenCounter("o200k_base")
    by_id: Message = {"role": "assistant", "content": None, "audio": {"id": "audio_abc"}}
    assert tiktoken_counter.message(by_id) == tiktoken_counter.message(silent) + tiktoken_counter.text('{"id":"audio_abc"}')


async def test_a_clip_and_a_document_are_sent(proxy: Proxy, upstream: FakeUpstream) -> None:
    """Ten seconds of speech and a two-page PDF (some 3,300 tokens) on a 100,000-token window:
    counted as text they were over 300,000, and memproxy refused what the provider would take."""
    upstream.enqueue(Reply(content="It says hello."))
    content: Any = [{"type": "text", "text": "What is said, and what does the report say?"},
                    audio_part(wav(10)), file_part(pdf(2))]
    answer = await proxy.client().chat.completions.create(model="big", messages=[{"role": "user", "content": content}])
    assert answer.choices[0].message.content == "It says hello."
    assert upstream.chat_requests()[-1].body["messages"][-1]["content"] == content


def test_the_counts_kept_are_bounded_in_characters_too() -> None:
    """Texts a request brings are counted once and kept, a bounded number of them, and a bounded
    number of characters: 8,192 texts of 4,096 four-byte characters (text with no spaces in a rare
    script) held some 265 MB per model."""
    import memproxy.tokens as tokens

    counter = TiktokenCounter("o200k_base")
    text = "\U00020000" * 3000
    for i in range(tokens._SHORT_CHARS // 3000 + 50):
        distinct = f"{i} {text}"
        assert counter.text(distinct) == len(counter.encoding.encode(distinct))
    kept = counter._short  # the cache itself: what memory holds
    assert sum(map(len, kept)) == counter._short_chars <= tokens._SHORT_CHARS
    assert len(kept) >= tokens._SHORT_CHARS // 3010  # as many as fit are kept: recent texts still hit


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "the page reads: hello"}, {"type": "image_url", "image_url": {"url": "https://a.example/1.png"}}],
    [{"type": "image_url", "image_url": {"url": "https://a.example/1.png"}}],
    [{"type": "image_url", "image_url": {"url": "https://a.example/1.png"}},
     {"type": "image_url", "image_url": {"url": "https://a.example/2.png"}}, {"type": "text", "text": "two shots"}],
], ids=["text-and-picture", "picture-alone", "two-pictures"])
@pytest.mark.parametrize("counter_kind", ["tiktoken", "litellm"])
def test_a_tool_message_with_pictures_counts_what_litellm_sends_for_it(content: list[Any], counter_kind: str) -> None:
    """litellm's OpenAI-compatible providers move a tool result's pictures into a user message after
    it, opened by a text of litellm's (`hoist_images_from_tool_messages`): the count of the message
    as stored is the count of what goes, and the texts memproxy counts are litellm's own."""
    litellm = load_litellm()
    common = importlib.import_module("litellm.litellm_core_utils.prompt_templates.common_utils")
    assert (HOISTED_IMAGES_BOUNDARY, HOISTED_IMAGES_PLACEHOLDER) == (
        common.TOOL_RESULT_IMAGE_BOUNDARY, common.TOOL_RESULT_IMAGE_PLACEHOLDER)
    counter: Any = TiktokenCounter("o200k_base") if counter_kind == "tiktoken" else LitellmCounter(
        litellm, "anthropic/claude-3-5-sonnet-20240620")
    message = {"role": "tool", "tool_call_id": "call_1", "content": content}
    sent = common.hoist_images_from_tool_messages([message])
    assert len(sent) == 2 and sent[1]["role"] == "user"
    assert counter.message(message) == sum(counter.message(m) for m in sent)
