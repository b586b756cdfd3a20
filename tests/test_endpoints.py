"""The OpenAI endpoints besides chat (embeddings, legacy completions, moderations, images,
transcriptions, speech, one model), driven by the official SDK through the proxy to the fake
provider, on both transports: what the provider received, what the client got back, what the
tenant was charged, and every error in the OpenAI shape."""

from __future__ import annotations

import io
import logging
import struct
import wave
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from fake_upstream import FakeUpstream, Received, Reply, speech_audio
from memproxy.config import Config

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

ENDPOINTS = ["/v1/audio/speech", "/v1/audio/transcriptions", "/v1/completions", "/v1/embeddings",
             "/v1/images/edits", "/v1/images/generations", "/v1/moderations"]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))  # an image's first bytes: the fake reads no further


def wav(seconds: float = 0.1, rate: int = 8000) -> bytes:
    """A small mono 16-bit WAV file: a rising ramp, so its bytes are not all alike."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", (i * 37) % 30000) for i in range(int(seconds * rate))))
    return out.getvalue()


def only(upstream: FakeUpstream, path: str) -> Received:
    """The one request the provider received at `path`, with the upstream key and not the client's."""
    received = upstream.requests_to(path)
    assert len(received) == 1, f"{len(received)} requests to {path}"
    assert_upstream_key(received[0])
    return received[0]


def assert_upstream_key(received: Received) -> None:
    assert received.headers.get("Authorization") == "Bearer upstream-secret"
    assert not any(PROXY_KEY in value for value in received.headers.values())


async def usage_of(proxy: Proxy, key: str = PROXY_KEY) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.url}/usage", headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status == 200
            result: dict[str, Any] = await response.json()
            return result


async def post(proxy: Proxy, path: str, key: str | None = PROXY_KEY, **kwargs: Any) -> tuple[int, Any, Any]:
    """A raw request: its status, JSON body and headers."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **kwargs.pop("headers", {})}
    async with aiohttp.ClientSession() as http:
        async with http.request(kwargs.pop("method", "POST"), f"{proxy.server.make_url(path)}", headers=headers,
                                **kwargs) as response:
            return response.status, await response.json(content_type=None), response.headers


def assert_error(body: Any, *, type: str, code: str | None, param: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["message"] and (body["error"]["type"], body["error"]["code"]) == (type, code)
    assert body["error"]["param"] == param


# --- each endpoint -------------------------------------------------------------------------------


async def test_embeddings_go_to_the_configured_model_and_count_for_the_tenant(
        proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(session=None)
    result = await client.embeddings.create(model="small", input=["hello there world", "x"], dimensions=4,
                                            encoding_format="float", user="end-user-7")
    assert [d.embedding for d in result.data] == [[0.5] * 4, [1.5] * 4]
    assert result.usage.prompt_tokens == 4
    body = only(upstream, "/v1/embeddings").body
    # The provider's name for the model, and every parameter the client sent.
    assert body["model"] == "small" and body["input"] == ["hello there world", "x"]
    assert (body["dimensions"], body["encoding_format"], body["user"]) == (4, "float", "end-user-7")

    usage = await usage_of(proxy)
    assert usage["endpoints"] == {"embeddings": {"calls": 1, "prompt_tokens": 4, "completion_tokens": 0,
                                                 "cost": None}}
    assert (usage["prompt_tokens"], usage["turns"], usage["sessions"]) == (4, 0, 0)
    assert (await usage_of(proxy, OTHER_KEY))["endpoints"] == {}  # tenant b spent nothing


async def test_a_priced_model_costs_what_litellm_says(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(usage={"prompt_tokens": 1000, "total_tokens": 1000}))
    await proxy.client(session=None).embeddings.create(model="big", input="x")  # openai/gpt-4o-mini: priced
    assert only(upstream, "/v1/embeddings").body["model"] == "gpt-4o-mini"
    spent = (await usage_of(proxy))["endpoints"]["embeddings"]
    assert spent["prompt_tokens"] == 1000 and spent["cost"] is not None and spent["cost"] > 0


async def test_a_legacy_completion(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="once upon a time"))
    result = await proxy.client(session=None).completions.create(model="small", prompt="Tell me", max_tokens=5,
                                                                  temperature=0.5)
    assert result.choices[0].text == "once upon a time" and result.choices[0].finish_reason == "stop"
    body = only(upstream, "/v1/completions").body
    assert (body["model"], body["prompt"], body["max_tokens"], body["temperature"]) == ("small", "Tell me", 5, 0.5)
    assert "stream" not in body
    spent = (await usage_of(proxy))["endpoints"]["completions"]
    assert (spent["calls"], spent["prompt_tokens"], spent["completion_tokens"]) == (1, 7, 3)


async def test_a_streamed_legacy_completion_ends_with_done_and_is_accounted(
        proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(session=None)
    upstream.enqueue(Reply(content="once upon a time"))
    stream = await client.completions.create(model="small", prompt="Tell me", stream=True)
    chunks = [chunk async for chunk in stream]
    # Every choice has its text, "" on the last (a client may join them without a None check).
    assert all(isinstance(c.choices[0].text, str) for c in chunks if c.choices)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "once upon a time"
    assert all(c.usage is None for c in chunks)  # not asked for: the usage memproxy asked for is hidden
    body = only(upstream, "/v1/completions").body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    spent = (await usage_of(proxy))["endpoints"]["completions"]
    assert spent["calls"] == 1 and spent["prompt_tokens"] > 0 and spent["completion_tokens"] > 0

    # Asked for, the usage reaches the client.
    stream = await client.completions.create(model="small", prompt="Again", stream=True,
                                             stream_options={"include_usage": True})
    usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens > 0
    assert (await usage_of(proxy))["endpoints"]["completions"]["calls"] == 2


async def test_raw_stream_is_server_sent_events_ending_with_done(proxy: Proxy, upstream: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/completions", json={"model": "small", "prompt": "p", "stream": True},
                             headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            text = (await response.read()).decode()
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


async def test_moderations(proxy: Proxy, upstream: FakeUpstream) -> None:
    result = await proxy.client(session=None).moderations.create(model="small", input="attack the castle")
    assert result.results[0].flagged is True and result.results[0].categories.violence is True
    assert only(upstream, "/v1/moderations").body == {"model": "small", "input": "attack the castle"}
    assert (await usage_of(proxy))["endpoints"]["moderations"]["calls"] == 1


async def test_image_generation(proxy: Proxy, upstream: FakeUpstream) -> None:
    result = await proxy.client(session=None).images.generate(model="small", prompt="a cat", n=2, size="256x256")
    assert [d.b64_json for d in result.data or []] == ["iVBORw0KGgo="] * 2
    body = only(upstream, "/v1/images/generations").body
    assert (body["model"], body["prompt"], body["n"], body["size"]) == ("small", "a cat", 2, "256x256")
    assert (await usage_of(proxy))["endpoints"]["images"]["calls"] == 1


async def test_an_image_edit_sends_its_images_mask_and_fields(proxy: Proxy, upstream: FakeUpstream,
                                                              transport: str) -> None:
    """The images, the mask and every field reach the provider; memproxy's own client keeps the
    files' names as sent, litellm names them itself (`image.png`, `mask.png`)."""
    client = proxy.client(session=None)
    kept = transport == "openai"
    result = await client.images.edit(model="small", image=[("a.png", PNG, "image/png"), ("b.png", PNG[::-1], "image/png")],
                                      mask=("m.png", PNG[:20], "image/png"), prompt="make it blue", n=2,
                                      size="256x256", background="transparent")
    assert [d.revised_prompt for d in result.data or []] == ["make it blue"] * 2
    body = only(upstream, "/v1/images/edits").body
    assert (body["model"], body["prompt"], body["n"], body["size"]) == ("small", "make it blue", "2", "256x256")
    assert body["background"] == "transparent"
    assert [(field, name if kept else "-", data) for field, name, data, _ in body["files"]] == [
        ("image[]", "a.png" if kept else "-", PNG), ("image[]", "b.png" if kept else "-", PNG[::-1]),
        ("mask", "m.png" if kept else "-", PNG[:20])]
    assert (await usage_of(proxy))["endpoints"]["image_edits"] == {"calls": 1, "prompt_tokens": 150,
                                                                   "completion_tokens": 100, "cost": None}

    await client.images.edit(model="small", image=("one.png", PNG, "image/png"), prompt="again")
    [one] = [r.body["files"] for r in upstream.requests_to("/v1/images/edits")][1:]
    assert [(name if kept else "-", data) for _, name, data, _ in one] == [("one.png" if kept else "-", PNG)]


async def test_an_image_edit_without_what_it_needs_is_a_400(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(session=None)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.edit(model="small", image=("a.png", PNG, "image/png"), prompt="")
    assert caught.value.body["param"] == "prompt"
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("model", "small")
    form.add_field("prompt", "x")
    status, body, _ = await post(proxy, "/v1/images/edits", data=form)
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None, param="image")
    status, body, _ = await post(proxy, "/v1/images/edits", json={"model": "small", "prompt": "x"})
    assert status == 400 and "multipart/form-data" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.edit(model="small", image=("a.png", PNG, "image/png"), prompt="x", stream=True)
    assert caught.value.body["param"] == "stream"
    assert upstream.received == []


async def test_transcription_of_an_uploaded_file(proxy: Proxy, upstream: FakeUpstream) -> None:
    audio = wav()
    client = proxy.client(session=None)
    result = await client.audio.transcriptions.create(model="small", file=("grüße (1).wav", audio, "audio/wav"),
                                                      language="en", temperature=0.2)
    assert result.text == f"heard {len(audio)} bytes"
    body = only(upstream, "/v1/audio/transcriptions").body
    assert body["file"]["bytes"] == audio and body["file"]["filename"] == "grüße (1).wav"
    assert (body["model"], body["language"], float(body["temperature"])) == ("small", "en", 0.2)
    assert body.get("response_format", "json") == "json"  # OpenAI's default, as the client left it
    assert (await usage_of(proxy))["endpoints"]["transcriptions"]["calls"] == 1

    # The text formats answer the text itself.
    upstream.enqueue(Reply(content="just words"))
    text = await client.audio.transcriptions.create(model="small", file=("clip.wav", audio, "audio/wav"),
                                                    response_format="text")
    assert str(text).strip() == "just words"


async def test_transcription_usage_in_tokens_is_accounted(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(usage={"type": "tokens", "input_tokens": 30, "output_tokens": 4, "total_tokens": 34,  # type: ignore[dict-item]
                                  "input_token_details": {"text_tokens": 0, "audio_tokens": 30}}))
    await proxy.client(session=None).audio.transcriptions.create(model="small", file=("a.wav", wav(), "audio/wav"))
    spent = (await usage_of(proxy))["endpoints"]["transcriptions"]
    assert (spent["prompt_tokens"], spent["completion_tokens"]) == (30, 4)


async def test_speech_comes_back_as_audio_bytes(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(session=None)
    response = await client.audio.speech.create(model="small", input="hello there", voice="alloy",
                                                response_format="mp3")
    assert response.content == speech_audio("hello there")
    assert response.response.headers["content-type"] == "audio/mpeg"
    body = only(upstream, "/v1/audio/speech").body
    assert body == {"model": "small", "input": "hello there", "voice": "alloy", "response_format": "mp3"}

    async with client.audio.speech.with_streaming_response.create(model="small", input="again",
                                                                  voice="alloy") as streamed:
        assert b"".join([data async for data in streamed.iter_bytes()]) == speech_audio("again")
    assert (await usage_of(proxy))["endpoints"]["speech"] == {"calls": 2, "prompt_tokens": 0,
                                                              "completion_tokens": 0, "cost": None}


async def test_a_model_is_retrieved_by_name(proxy: Proxy) -> None:
    client = proxy.client(session=None)
    model = await client.models.retrieve("big")
    assert (model.id, model.object, model.owned_by) == ("big", "model", "memproxy")
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("gpt-nope")
    assert_error({"error": caught.value.body}, type="invalid_request_error",
                 code="model_not_found", param="model")


async def test_every_openai_endpoint_is_served_without_v1_too(proxy: Proxy, upstream: FakeUpstream) -> None:
    """A client whose `base_url` lacks `/v1` reaches every OpenAI endpoint, with memory, as LiteLLM's
    proxy serves it; the key is asked for there as under `/v1`; memproxy's own API stays under `/v1`."""
    bare = openai.AsyncOpenAI(base_url=proxy.url.removesuffix("/v1"), api_key=PROXY_KEY, max_retries=0,
                              default_headers={"X-Session-Id": "no-prefix"})
    proxy.clients.append(bare)
    answer = await bare.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi there"}])
    assert answer.choices[0].message.content
    assert [m.id async for m in bare.models.list()] == ["small", "big"]
    assert (await bare.models.retrieve("big")).id == "big"
    assert (await bare.embeddings.create(model="small", input="x")).data
    response = await bare.responses.create(model="small", input="and now?")
    assert (await bare.responses.retrieve(response.id)).id == response.id
    # The chat turn and the Responses turn are the session's, stored as under /v1.
    status, shown, _ = await post(proxy, "/v1/sessions/no-prefix", method="GET")
    assert status == 200 and [m["message"]["role"] for m in shown["messages"]] == ["user", "assistant"] * 2

    # Every OpenAI route under /v1 is there without it, behind the key: a wrong one is a 401 and
    # nothing goes upstream.
    before = len(upstream.received)
    routes = sorted({(route.method, route.resource.canonical) for route in proxy.app.router.routes()
                     if route.resource is not None and route.resource.canonical.startswith("/v1/")
                     and not route.resource.canonical.startswith(("/v1/sessions", "/v1/search", "/v1/usage"))
                     and route.method != "HEAD"})
    assert len(routes) >= 20
    for method, path in routes:
        bare_path = path.removeprefix("/v1").replace("{", "").replace("}", "")
        for alias in (bare_path, "/openai" + bare_path):  # and where Azure OpenAI's clients call it
            status, body, _ = await post(proxy, alias, key="not-a-key", method=method)
            assert status == 401, (method, alias)
            assert_error(body, type="authentication_error", code="invalid_api_key")
    assert len(upstream.received) == before

    # memproxy's own API is not: a 404 that lists what is served, and says so.
    for method, path in [("GET", "/sessions"), ("GET", "/usage"), ("POST", "/search")]:
        status, body, _ = await post(proxy, path, method=method)
        assert status == 404, path
        assert "each also without /v1" in body["error"]["message"]


# --- what every endpoint refuses -----------------------------------------------------------------


def call_each(client: openai.AsyncOpenAI, model: str = "small") -> list[Any]:
    """One call to each endpoint, unawaited."""
    return [
        client.embeddings.create(model=model, input="x"),
        client.completions.create(model=model, prompt="x"),
        client.completions.create(model=model, prompt="x", stream=True),
        client.moderations.create(model=model, input="x"),
        client.images.generate(model=model, prompt="x"),
        client.images.edit(model=model, image=("a.png", PNG, "image/png"), prompt="x"),
        client.audio.transcriptions.create(model=model, file=("a.wav", wav(0.01), "audio/wav")),
        client.audio.speech.create(model=model, input="x", voice="alloy"),
    ]


async def test_a_models_own_headers_go_with_every_endpoints_request(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    headers = {"HTTP-Referer": "https://app.example", "X-Gateway-Key": "gw-secret-1"}
    proxy = await start_proxy(replace(config, models=tuple(
        replace(m, headers=headers) if m.name == "small" else m for m in config.models)))
    for call in call_each(proxy.client(session=None), "small"):
        response = await call
        if isinstance(response, openai.AsyncStream):
            async for _ in response:
                pass
    for call in call_each(proxy.client(session=None), "big"):  # a model without headers of its own
        response = await call
        if isinstance(response, openai.AsyncStream):
            async for _ in response:
                pass
    sent = [(r.body["model"], r) for r in upstream.received]
    assert len(sent) == 16
    for model, received in sent:
        assert_upstream_key(received)
        lower = {k.lower(): v for k, v in received.headers.items()}
        mine = {k.lower(): v for k, v in headers.items()}
        if model == "small":
            assert {k: lower.get(k) for k in mine} == mine, received.path
        else:
            assert not set(mine) & set(lower), received.path


async def test_a_wrong_key_is_refused_before_anything_goes_upstream(proxy: Proxy, upstream: FakeUpstream) -> None:
    for call in call_each(proxy.client(session=None, key="not-a-key")):
        with pytest.raises(openai.AuthenticationError) as caught:
            await call
        assert_error({"error": caught.value.body}, type="authentication_error", code="invalid_api_key")
    for path in ENDPOINTS:  # no key at all
        status, body, _ = await post(proxy, path, key=None, json={"model": "small", "input": "x"})
        assert status == 401
        assert_error(body, type="authentication_error", code="invalid_api_key")
    assert upstream.received == []


async def test_an_unknown_model_is_a_404_model_not_found(proxy: Proxy, upstream: FakeUpstream) -> None:
    for call in call_each(proxy.client(session=None), model="gpt-unknown"):
        with pytest.raises(openai.NotFoundError) as caught:
            await call
        assert_error({"error": caught.value.body}, type="invalid_request_error", code="model_not_found",
                     param="model")
    assert upstream.received == []
    status, body, _ = await post(proxy, "/v1/embeddings", json={"input": "x"})
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None, param="model")


async def test_an_admin_key_cannot_call_a_model(start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(replace(config, auth=replace(config.auth, admin_keys=("admin-key-z",))))
    for path in ENDPOINTS:
        status, body, _ = await post(proxy, path, key="admin-key-z", json={"model": "small", "input": "x"})
        assert status == 403
        assert_error(body, type="permission_error", code="forbidden")
    assert upstream.received == []


async def test_a_body_over_the_limit_is_a_413(start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(replace(config, server=replace(config.server, max_body_bytes=4096)))
    client = proxy.client(session=None)
    calls = [client.embeddings.create(model="small", input="word " * 2000),
             client.completions.create(model="small", prompt="word " * 2000),
             client.audio.transcriptions.create(model="small", file=("a.wav", wav(1.0), "audio/wav")),
             client.audio.speech.create(model="small", input="word " * 2000, voice="alloy")]
    for call in calls:
        with pytest.raises(openai.APIStatusError) as caught:
            await call
        assert caught.value.status_code == 413
        assert_error({"error": caught.value.body}, type="invalid_request_error", code="request_too_large")
        assert "4096" in caught.value.message
    assert upstream.received == []


async def test_an_upstream_failure_is_the_providers_status_in_the_openai_shape(
        proxy: Proxy, upstream: FakeUpstream, transport: str) -> None:
    for index, call in enumerate(call_each(proxy.client(session=None))):
        upstream.reset()
        upstream.enqueue(*[Reply(status=500, error_message=f"overloaded {index}", error_param="input")] * 3)
        with pytest.raises(openai.InternalServerError) as caught:
            await call
        assert caught.value.status_code == 500
        # litellm keeps the message alone of a streamed completion's error, an image's or an audio call's
        # (an image edit's it keeps whole)
        message_only = transport == "litellm" and index in (2, 4, 6, 7)
        assert_error({"error": caught.value.body}, type="upstream_error", code="upstream_error",
                     param=None if message_only else "input")
        assert caught.value.body["message"] == f"overloaded {index}"  # type: ignore[index]  # as the provider said it
        # Not retried: the client retries if it wants to. litellm's OpenAI image call retries twice.
        retried = transport == "litellm" and upstream.received[0].path.endswith("/images/generations")
        assert len(upstream.received) == (3 if retried else 1)
        assert_upstream_key(upstream.received[0])
    assert (await usage_of(proxy))["endpoints"] == {}  # nothing answered, nothing charged


async def test_a_bad_request_upstream_keeps_its_status(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(status=400, error_message="input is too long"))
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client(session=None).embeddings.create(model="small", input="x")
    assert caught.value.status_code == 400 and "input is too long" in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_a_stream_cut_upstream_ends_with_an_error_and_charges_nothing(
        proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(session=None)
    upstream.enqueue(Reply(content="once upon a time", cut_stream=True))
    stream = await client.completions.create(model="small", prompt="Tell me", stream=True)
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert caught.value.body["code"] in ("upstream_incomplete", "upstream_error")  # type: ignore[index]
    upstream.enqueue(Reply(cut_stream=True))
    with pytest.raises(openai.APIError):  # a broken body, or (litellm reads it whole) a 502
        await client.audio.speech.create(model="small", input="hello there", voice="alloy")
    assert (await usage_of(proxy))["endpoints"] == {}


@pytest.mark.parametrize("path, body, missing", [
    ("/v1/embeddings", {}, "input"), ("/v1/completions", {}, "prompt"), ("/v1/moderations", {}, "input"),
    ("/v1/images/generations", {}, "prompt"), ("/v1/audio/speech", {"voice": "alloy"}, "input"),
    ("/v1/audio/speech", {"input": "hello"}, "voice"), ("/v1/completions", {"prompt": None}, "prompt"),
])
async def test_a_call_without_what_it_needs_is_a_400_naming_it(
        proxy: Proxy, upstream: FakeUpstream, path: str, body: dict[str, Any], missing: str) -> None:
    """The client's mistake, not the provider's failure: no 502 for an SDK to retry, nothing sent."""
    status, answer, _ = await post(proxy, path, json={"model": "small", **body})
    assert status == 400
    assert_error(answer, type="invalid_request_error", code=None, param=missing)
    assert upstream.received == []


async def test_a_legacy_completion_the_provider_never_finished_is_an_error_not_an_answer(
        proxy: Proxy, upstream: FakeUpstream, transport: str) -> None:
    """The provider's stream stops cleanly half way, with no finish reason and no `[DONE]`: the
    client gets an error event, and nothing is charged."""
    if transport == "litellm":
        pytest.skip("litellm finishes a legacy completion's cut stream itself and keeps no note of it "
                    "(README, Providers: what litellm itself loses)")
    upstream.enqueue(Reply(content="once upon a time", end_stream_early=True))
    stream = await proxy.client(session=None).completions.create(model="small", prompt="Tell me", stream=True)
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert caught.value.body["code"] == "upstream_incomplete"  # type: ignore[index]
    assert (await usage_of(proxy))["endpoints"] == {}


async def test_each_call_logs_one_request_line_with_its_model(
        proxy: Proxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture) -> None:
    """The request line (`memproxy.observe`) is the one line a call writes, whatever its endpoint;
    a stream that an error ends is logged with that error's status, not its headers' 200."""
    caplog.set_level(logging.INFO)
    client = proxy.client(session=None)
    await client.embeddings.create(model="small", input="x")
    upstream.enqueue(Reply(content="once upon a time", cut_stream=True))
    with pytest.raises(openai.APIError):
        async for _ in await client.completions.create(model="small", prompt="Tell me", stream=True):
            pass
    lines = [r for r in caplog.records if r.name.startswith("memproxy") and r.name != "memproxy.http"
             and r.levelno < logging.WARNING]
    assert lines == []  # no second line of an endpoint's own
    requests = [r.__dict__ for r in caplog.records if r.name == "memproxy.http"]
    assert [(r["route"], r["model"], r["stream"]) for r in requests] == [
        ("/v1/embeddings", "small", False), ("/v1/completions", "small", True)]
    assert requests[0]["status"] == 200
    # The error event's: memproxy's own client finds the stream cut short; litellm maps the cut to
    # the provider's 500.
    assert requests[1]["status"] >= 500 and requests[1]["error"] in ("upstream_incomplete", "upstream_error")


async def test_the_proxy_refuses_streams_it_cannot_relay(proxy: Proxy, upstream: FakeUpstream) -> None:
    status, body, _ = await post(proxy, "/v1/images/generations", json={"model": "small", "prompt": "x",
                                                                        "stream": True})
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None, param="stream")
    status, body, _ = await post(proxy, "/v1/completions", json={"model": "small", "prompt": "x", "stream": "yes"})
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None, param="stream")
    status, body, _ = await post(proxy, "/v1/audio/transcriptions", data={"model": "small"})
    assert status == 400  # not a multipart form
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("model", "small")
    status, body, _ = await post(proxy, "/v1/audio/transcriptions", data=form)
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None, param="file")
    # A part whose header line is broken (no colon): aiohttp's parser raises its own error, once a 500.
    status, body, _ = await post(proxy, "/v1/audio/transcriptions", data=b"--zz\r\nbroken\r\n\r\nx\r\n--zz--\r\n",
                                 headers={"Content-Type": "multipart/form-data; boundary=zz"})
    assert status == 400
    assert_error(body, type="invalid_request_error", code=None)
    # A field in a charset Python does not know, a part in a transfer encoding nobody does: 500s once.
    for headers in (b"Content-Type: text/plain; charset=bogus", b"Content-Transfer-Encoding: bogus"):
        form_bytes = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n' + headers + b"\r\n\r\nsmall\r\n"
                      b"--zz--\r\n")
        status, body, _ = await post(proxy, "/v1/audio/transcriptions", data=form_bytes,
                                     headers={"Content-Type": "multipart/form-data; boundary=zz"})
        assert status == 400, body
        assert_error(body, type="invalid_request_error", code=None)
    assert upstream.received == []


@pytest.mark.parametrize("disposition, content_type", [
    (b'name="file"; filename="clip\xff.wav"', b"audio/wav"),
    (b'name="file"; filename="clip.wav"', b"audio/\xffwav"),
    (b'name="x\xff"', b"text/plain"),
], ids=["file-name", "content-type", "field-name"])
async def test_a_form_part_named_in_bytes_that_are_not_utf_8_is_a_400(
    proxy: Proxy, upstream: FakeUpstream, disposition: bytes, content_type: bytes
) -> None:
    """What names a part goes on to the provider, and aiohttp reads its bytes that are not UTF-8 as
    lone surrogates, which nothing can encode: the call failed as `upstream_unreachable` (502)
    through litellm, with a 500 through memproxy's own client. Nothing is sent."""
    audio = b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
    form = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nsmall\r\n'
            + (b"" if b'"file"' in disposition else audio)
            + b"--zz\r\nContent-Disposition: form-data; " + disposition + b"\r\nContent-Type: " + content_type
            + b"\r\n\r\nRIFF\r\n--zz--\r\n")
    status, body, _ = await post(proxy, "/v1/audio/transcriptions", data=form,
                                 headers={"Content-Type": "multipart/form-data; boundary=zz"})
    assert status == 400, body
    assert_error(body, type="invalid_request_error", code=None)
    assert "not UTF-8" in body["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"), ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, "x"]]}, "prompt"), ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": [True]}, "input"), ("/v1/moderations", {"input": [1]}, "input"),
    ("/v1/images/generations", {"prompt": ["a"]}, "prompt"), ("/v1/audio/speech", {"input": 1, "voice": "x"}, "input"),
])
async def test_an_input_of_the_wrong_shape_is_a_400(proxy: Proxy, upstream: FakeUpstream, path: str,
                                                    body: dict[str, Any], param: str) -> None:
    """Inputs OpenAI's API refuses: litellm refused them in its own code, which read as a failed
    upstream call (502)."""
    status, answer, _ = await post(proxy, path, json={"model": "small", **body})
    assert status == 400
    assert_error(answer, type="invalid_request_error", code=None, param=param)
    assert upstream.received == []


async def test_inputs_of_every_accepted_shape_go_upstream(proxy: Proxy, upstream: FakeUpstream, transport: str) -> None:
    for prompt in ("one", ["one", "two"], [1, 2, 3], [[1, 2], [3]]):
        status, answer, _ = await post(proxy, "/v1/embeddings", json={"model": "small", "input": prompt})
        assert status == 200, answer
        status, answer, _ = await post(proxy, "/v1/completions", json={"model": "small", "prompt": prompt})
        assert status == 200, answer
    status, answer, _ = await post(proxy, "/v1/moderations", json={"model": "small", "input": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]})
    assert status == 200, answer
    # A custom voice is an object (`{"id": ...}`), a built-in one its name. litellm takes the object
    # for some providers' speech, not for OpenAI's: there the refusal is litellm's, a 400.
    for voice in ("alloy", {"id": "voice_1234"}):
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.server.make_url("/v1/audio/speech"),
                                 headers={"Authorization": f"Bearer {PROXY_KEY}"},
                                 json={"model": "small", "input": "hi", "voice": voice}) as response:
                refused = transport == "litellm" and isinstance(voice, dict)
                assert response.status == (400 if refused else 200), await response.text()
    voices = [r.body["voice"] for r in upstream.requests_to("/v1/audio/speech")]
    assert voices == (["alloy"] if transport == "litellm" else ["alloy", {"id": "voice_1234"}])


async def test_a_client_cannot_redirect_the_upstream_call(proxy: Proxy, upstream: FakeUpstream) -> None:
    """`api_base`, `api_key` in the body are the client's parameters, never the proxy's settings:
    the call goes to the configured provider with the configured key."""
    status, _, _ = await post(proxy, "/v1/embeddings", json={"model": "small", "input": "x",
                                                             "api_base": "http://127.0.0.1:9/v1",
                                                             "api_key": "stolen"})
    assert status == 200
    received = only(upstream, "/v1/embeddings")
    assert received.headers["Authorization"] == "Bearer upstream-secret"


# --- paths that do not exist ---------------------------------------------------------------------


async def test_an_unknown_path_is_a_404_that_lists_the_endpoints(proxy: Proxy, upstream: FakeUpstream) -> None:
    for method, path in [("POST", "/v1/nothing/here"), ("GET", "/v1/files"), ("POST", "/v1/engines/x/completions"),
                         ("GET", "/nowhere")]:
        status, body, _ = await post(proxy, path, method=method)
        assert status == 404, path
        assert_error(body, type="not_found_error", code="not_found")
        message = body["error"]["message"]
        assert f"({method} {path})" in message
        for served in ["POST /v1/chat/completions", "POST /v1/embeddings", "POST /v1/completions",
                       "POST /v1/moderations", "POST /v1/images/generations", "POST /v1/audio/transcriptions",
                       "POST /v1/audio/speech", "GET /v1/models", "GET /v1/models/{model}", "POST /v1/conversations",
                       "DELETE/GET/POST /v1/conversations/{conversation_id}",
                       "GET/POST /v1/conversations/{conversation_id}/items",
                       "DELETE/GET /v1/conversations/{conversation_id}/items/{item_id}"]:
            assert served in message, served
    # A known path with another method stays a 405 that says what it allows, and what memproxy
    # serves: an SDK's endpoint memproxy lacks may share a path with one it has.
    for method, path, allowed in [("GET", "/v1/embeddings", "POST"), ("GET", "/v1/chat/completions", "POST"),
                                  ("POST", "/v1/responses/compact", "DELETE,GET,HEAD")]:
        status, body, headers = await post(proxy, path, method=method)
        assert status == 405 and headers["Allow"] == allowed, path
        assert_error(body, type="invalid_request_error", code="method_not_allowed")
        message = body["error"]["message"]
        assert message.startswith(f"memproxy does not serve {method} {path} (that path takes ")
        assert "POST /v1/chat/completions" in message and "POST /v1/responses" in message
    # A wrong key on an unknown path under /v1 is a 401 first, as on a known one.
    status, body, _ = await post(proxy, "/v1/nothing", key="not-a-key")
    assert status == 401
    assert upstream.received == []
