"""The OpenAI endpoints besides chat: embeddings, legacy completions, moderations, image generation,
transcriptions and speech, passed through to the configured model without memory.

Each is what chat is without a session: the caller's tenant key, a body within
`server.max_body_bytes`, `model` naming a configured model (whose provider name, base URL, key and
timeout are used: the client's proxy key never goes upstream), every other parameter passed on, and
errors in the OpenAI shape. A legacy completion streams when asked (`stream: true`), speech is relayed
as it comes; the others answer whole.

A call belongs to no session, so what it spent (the tokens the provider reported, and the cost
where litellm knows the model's price) is added to its tenant's `endpoint_usage`, which `GET
/v1/usage` and `memproxy sessions usage` report. It is written before the client is told the answer
is complete, as an app-owned task, so a client that goes away then still has it accounted. A store
that fails then costs the accounting (logged), never the answer the provider gave.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import BodyPartReader, MultipartReader, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from .bodies import body_bytes, json_object, requested_model
from .config import ModelConfig
from .errors import BadRequest, Forbidden, ProxyError, UpstreamError, error_body
from .jsonbytes import dumps
from .observe import CLIENT_GONE, notes
from .provider import Endpoint, JsonEndpoint, UploadedFile
from .streaming import hiding_usage
from .store import EndpointUsage
from .typedefs import CALLER, CONFIG, PROVIDER, STORE, TASKS, AddRoute

log = logging.getLogger("memproxy.endpoints")

# What each endpoint cannot do without, as OpenAI's API requires it: refused here, a 400 naming it,
# rather than litellm's own failure to find it (a 502, which an SDK retries).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "embeddings": ("input",), "completions": ("prompt",), "moderations": ("input",), "images": ("prompt",),
    "speech": ("input", "voice"),
}


def _require(endpoint: str, body: dict[str, Any]) -> None:
    for name in _REQUIRED[endpoint]:
        value = body.get(name)
        if value is None:
            raise BadRequest(f"'{name}' is required", param=name)
        shaped, shape = _SHAPES.get(name, _SHAPES[endpoint])
        if not isinstance(value, str) and not shaped(value):
            raise BadRequest(f"'{name}' must be {shape}", param=name)


def _tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _texts(value: Any) -> bool:
    return _tokens(value) or isinstance(value, list) and bool(value) and all(
        isinstance(v, str) or _tokens(v) for v in value)


# The shapes OpenAI's API takes for each required input besides a string, by endpoint or, where it
# differs, by field: litellm refuses another in its own code, which reads as a failed upstream call
# (a 502 an SDK retries).
_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "embeddings": (_texts, "a string or a non-empty array of strings or of token arrays"),
    "completions": (_texts, "a string or a non-empty array of strings or of token arrays"),
    "moderations": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(p, (str, dict)) for p in v),
                    "a string or a non-empty array"),
    "images": (lambda v: False, "a string"),
    "speech": (lambda v: False, "a string"),
    "voice": (lambda v: isinstance(v, dict), "a string or an object"),  # a custom voice: {"id": ...}
}


def add_routes(add: AddRoute) -> None:
    add("POST", "/v1/embeddings", embeddings)
    add("POST", "/v1/completions", completions)
    add("POST", "/v1/moderations", moderations)
    add("POST", "/v1/images/generations", images)
    add("POST", "/v1/images/edits", image_edits)
    add("POST", "/v1/audio/transcriptions", transcriptions)
    add("POST", "/v1/audio/speech", speech)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _json_call(request, "embeddings")


async def moderations(request: web.Request) -> web.StreamResponse:
    return await _json_call(request, "moderations")


async def images(request: web.Request) -> web.StreamResponse:
    return await _json_call(request, "images")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _json_call(request, "completions")


async def _json_call(request: web.Request, endpoint: JsonEndpoint) -> web.StreamResponse:
    tenant = _tenant(request)
    body = await json_object(request)
    model = _model(request, body.get("model"))
    _require(endpoint, body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean, or null", param="stream")
    stream = bool(stream)
    if stream and endpoint == "completions":
        return await _completion_stream(request, tenant, model, body)
    if stream:
        raise BadRequest(f"memproxy does not stream {endpoint}: leave 'stream' unset", param="stream")
    result = await request.app[PROVIDER].call(endpoint, model, body)
    await _account(request, tenant, endpoint, model, result.get("usage"))
    return web.Response(body=dumps(result), content_type="application/json", charset="utf-8")


async def transcriptions(request: web.Request) -> web.StreamResponse:
    tenant, fields, files, model = await _form_call(request, "a transcription", "its audio in the field 'file'",
                                                    "transcriptions")
    audio = next((upload for name, upload in files if name == "file"), None)
    if audio is None:
        raise BadRequest("'file' is required: the audio to transcribe", param="file")
    result = await request.app[PROVIDER].transcribe(model, fields, audio)
    await _account(request, tenant, "transcriptions", model, result.get("usage") if isinstance(result, dict) else None)
    if isinstance(result, str):
        return web.Response(text=result, content_type="text/plain")
    return web.Response(body=dumps(result), content_type="application/json", charset="utf-8")


async def image_edits(request: web.Request) -> web.StreamResponse:
    """`POST /v1/images/edits`: the images (`image`, or `image[]` for several) and the `mask` go to
    the provider as the client sent them, with the other fields; not streamed."""
    tenant, fields, files, model = await _form_call(
        request, "an image edit", "its images in the field 'image' (or 'image[]')", "image edits")
    if not any(name in ("image", "image[]") for name, _ in files):
        raise BadRequest("'image' is required: the image to edit", param="image")
    if not dict(fields).get("prompt"):
        raise BadRequest("'prompt' is required", param="prompt")
    result = await request.app[PROVIDER].edit_image(model, fields, files)
    await _account(request, tenant, "image_edits", model, result.get("usage"))
    return web.Response(body=dumps(result), content_type="application/json", charset="utf-8")


async def _form_call(request: web.Request, what: str, where: str, calls: str
                     ) -> tuple[str, list[tuple[str, str]], list[tuple[str, UploadedFile]], ModelConfig]:
    """A call sent as a form (`_form`): its tenant, fields, files and model. It is not streamed:
    a `stream` asked for is a 400 naming the `calls`."""
    tenant = _tenant(request)
    fields, files = await _form(request, what, where)
    values = dict(fields)
    model = _model(request, values.get("model"))
    if values.get("stream", "false").lower() != "false":
        raise BadRequest(f"memproxy does not stream {calls}: leave 'stream' unset", param="stream")
    return tenant, fields, files, model


async def speech(request: web.Request) -> web.StreamResponse:
    tenant = _tenant(request)
    body = await json_object(request)
    model = _model(request, body.get("model"))
    _require("speech", body)
    content_type, audio = await request.app[PROVIDER].speak(model, body)
    response = web.StreamResponse(headers={"Content-Type": content_type})
    try:
        async with aclosing(audio):
            first = await anext(audio, b"")  # an upstream that fails before its first bytes is a plain error
            await response.prepare(request)
            await response.write(first)
            async for data in audio:
                await response.write(data)
    except ConnectionError:
        notes(request).status = CLIENT_GONE
        return response
    except ProxyError as exc:
        if not response.prepared:
            raise
        # The audio is cut and nothing can say so in its bytes: the connection closes before the
        # body's end, so the client sees a broken response, not a short one.
        _note_error(request, exc)
        if request.transport is not None:
            request.transport.close()
        return response
    # Speech reports no tokens: the call is counted.
    await _account(request, tenant, "speech", model, None)
    await response.write_eof()
    return response


async def _completion_stream(request: web.Request, tenant: str, model: ModelConfig,
                             body: dict[str, Any]) -> web.StreamResponse:
    """As chat streams: the usage is asked for where the client did not ask, and then hidden from
    it; the stream ends with `[DONE]` once its usage is accounted, or with one error event."""
    options = body.get("stream_options")
    hide_usage = not (isinstance(options, dict) and options.get("include_usage") is True)
    if hide_usage:
        body = {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}
    notes(request).stream = True
    chunks = await request.app[PROVIDER].text_stream(model, body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        usage = await _relay(chunks, response, hide_usage)
        await _account(request, tenant, "completions", model, usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        notes(request).status = CLIENT_GONE
        return response
    except ProxyError as exc:  # the headers are out: the error ends the stream, as chat's do
        _note_error(request, exc)
        await _end_stream(response, exc.body())
        return response
    except Exception as exc:
        log.error("a completion stream failed after its headers: %s", type(exc).__name__)
        noted = notes(request)
        noted.status, noted.error = 500, "internal_error"
        await _end_stream(response, error_body("internal error", "server_error", "internal_error"))
        return response
    return response


async def _relay(chunks: AsyncGenerator[dict[str, Any], None], response: web.StreamResponse,
                 hide_usage: bool) -> dict[str, Any] | None:
    """Relay the chunks; returns the stream's usage once some choice has finished (anything less
    is an error). `hide_usage`: the client did not ask for the usage, and sees none (no `usage`
    field, no chunk that holds only usage)."""
    usage, finished = None, False
    async with aclosing(chunks):  # a client that went away releases the upstream connection now
        async for chunk in chunks:
            if chunk.get("usage"):
                usage = chunk["usage"]
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or [])
            shown = hiding_usage(chunk) if hide_usage else chunk
            if shown is not None:
                await response.write(b"data: " + dumps(shown) + b"\n\n")
    if not finished:  # ended without a finish reason: cut, not done
        raise ProxyError("the upstream stream ended before the completion was complete", status=502,
                         code="upstream_incomplete")
    return usage


async def _end_stream(response: web.StreamResponse, body: dict[str, Any]) -> None:
    try:
        await response.write(b"data: " + dumps(body) + b"\n\n")
    except ConnectionError:
        pass


def _tenant(request: web.Request) -> str:
    tenant = request[CALLER].tenant
    if tenant is None:
        raise Forbidden("An admin key manages sessions; call the model endpoints with a tenant's key.")
    return tenant


def _model(request: web.Request, name: Any) -> ModelConfig:
    """The model named: by the path where it names one (`/openai/deployments/{deployment}/...`, as
    Azure OpenAI's does), else `name`, the body's; noted for the request's log line and metrics
    (`memproxy.observe`)."""
    model = requested_model(request.app[CONFIG], request.match_info.get("deployment") or name)
    noted = notes(request)
    noted.model, noted.stream = model.name, False  # a legacy completion that streams says so after
    return model


def _note_error(request: web.Request, exc: ProxyError) -> None:
    """An error that ended an answer already under way: the request's status and code are its."""
    noted = notes(request)
    noted.status, noted.error = exc.status, exc.code or exc.type
    if isinstance(exc, UpstreamError):
        noted.upstream_status = exc.upstream_status


# The form fields that hold a file, even sent without a file name, and the name each then goes with.
_FILE_FIELDS = {"file": "audio", "image": "image", "image[]": "image", "mask": "mask"}


async def _form(request: web.Request, what: str, where: str
                ) -> tuple[list[tuple[str, str]], list[tuple[str, UploadedFile]]]:
    """A form (`what` is sent as one, `where` its files go): its fields in order (repeated `name[]`
    fields kept), and its files by field name, in order. The body is read whole first
    (`deadlines.body_deadline`, within `server.max_body_bytes`), so aiohttp's multipart parser reads
    it from those bytes."""
    if request.content_type != "multipart/form-data":
        raise BadRequest(f"{what} is sent as multipart/form-data, {where}")
    raw = await body_bytes(request)
    # Never paused: the stream holds no more than the body already read (`limit` above its size).
    stream = StreamReader(request.protocol, len(raw) + 1, loop=asyncio.get_running_loop())
    stream.feed_data(raw)
    stream.feed_eof()
    fields: list[tuple[str, str]] = []
    files: list[tuple[str, UploadedFile]] = []
    try:
        async for part in MultipartReader(request.headers, stream):
            if not isinstance(part, BodyPartReader) or part.name is None:
                continue  # a nested multipart, or a part without a name: nothing such a call takes
            _sendable(part)
            if part.filename is not None or part.name in _FILE_FIELDS:
                content_type = part.headers.get("Content-Type", "application/octet-stream")
                filename = part.filename or _FILE_FIELDS[part.name]
                files.append((part.name, UploadedFile(filename, bytes(await part.read()), content_type)))
            else:
                fields.append((part.name, await part.text()))
    except (ValueError, AssertionError, UnicodeDecodeError, LookupError, RuntimeError,
            HttpProcessingError) as exc:  # aiohttp's parser's (an unknown charset, transfer encoding)
        raise BadRequest(f"the form could not be read: {type(exc).__name__}") from exc
    return fields, files


def _sendable(part: BodyPartReader) -> None:
    """A part's name, file name and type, which go on to the provider, as text that can be sent:
    aiohttp reads header bytes that are not UTF-8 as lone surrogates, which no encoder takes (the
    call failed as `upstream_unreachable` through litellm, with a 500 through memproxy's client)."""
    named = (("name", part.name), ("filename", part.filename), ("Content-Type", part.headers.get("Content-Type")))
    for what, text in named:
        try:
            (text or "").encode()
        except UnicodeEncodeError:
            raise BadRequest(f"a form part's {what} is not UTF-8") from None


async def _account(request: web.Request, tenant: str, endpoint: Endpoint, model: ModelConfig,
                   usage: Any) -> None:
    """Add the call to the tenant's endpoint usage: the tokens the provider reported (OpenAI's
    `prompt_tokens`/`completion_tokens`, or the `input_tokens`/`output_tokens` of images and audio)."""
    counts = usage if isinstance(usage, dict) else {}
    prompt = _count(counts, "prompt_tokens", "input_tokens")
    completion = _count(counts, "completion_tokens", "output_tokens")
    cost = None
    if prompt is not None or completion is not None:
        cost = request.app[PROVIDER].cost(model, {"prompt_tokens": prompt or 0, "completion_tokens": completion or 0})
    spent = EndpointUsage(tenant, endpoint, 1, prompt or 0, completion or 0, cost)
    app = request.app
    try:
        await app[TASKS].run(app[STORE].add_endpoint_usage(spent))
    except Exception as exc:  # the answer is paid for: the client gets it; the lost count is logged
        log.error("accounting a %s call failed: %s", endpoint, type(exc).__name__)


def _count(counts: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = counts.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# --- what exists ---------------------------------------------------------------------------------

_SESSION_API = ("/v1/sessions", "/v1/usage", "/v1/search")


def served(app: web.Application) -> str:
    """The OpenAI endpoints this app serves, from its router (so a route added later, such as the
    Conversations API's, is listed)."""
    found: dict[str, set[str]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/v1/") and not path.startswith(_SESSION_API) and route.method != "HEAD":
            found.setdefault(path, set()).add(route.method)
    return ", ".join(f"{'/'.join(sorted(found[path]))} {path}" for path in sorted(found))


def not_found_message(request: web.Request) -> str:
    return f"Invalid URL ({request.method} {request.path}). {_serves(request.app)}"


def wrong_method_message(request: web.Request, allowed: str) -> str:
    """A 405's: an SDK calling an endpoint memproxy does not serve (`GET /v1/chat/completions`,
    OpenAI's stored completions; `POST /v1/responses/compact`; a method of the Conversations API
    memproxy lacks) lands on a path memproxy serves with another method, and should learn that, not
    only that the method was wrong."""
    return f"memproxy does not serve {request.method} {request.path} (that path takes {allowed}). {_serves(request.app)}"


def _serves(app: web.Application) -> str:
    return (f"memproxy serves {served(app)}, each also without /v1 and under /openai (Azure OpenAI's "
            "clients), and its session API under /v1/sessions.")
