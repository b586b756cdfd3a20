"""memproxy's own client for OpenAI-compatible providers: the request as the client sent it, over one
pooled aiohttp session.

For a provider that already speaks the OpenAI API (OpenAI itself, vLLM, llama.cpp, Ollama, LM Studio,
most gateways) there is nothing to translate: parameters go upstream byte for byte as the client sent
them, and the answer comes back as the provider wrote it, for about 0.3 ms of CPU a call
(docs/benchmarks.md). `Provider` uses this for models configured `transport: openai` (and, with
`transport: auto`, for `openai/...` models); litellm is the default.

Errors become `UpstreamError`s with the provider's own status and message, typed by the one status
table of `memproxy.errors`; a timeout is 504 and an unreachable provider 502, as on the litellm route.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from . import __version__
from .config import ModelConfig
from .errors import UpstreamError
from .jsonbytes import dumps
from .messages import Message

PREFIX = "openai/"
DEFAULT_BASE = "https://api.openai.com/v1"
_CODES = {400: "upstream_bad_request", 401: "upstream_unauthorized", 403: "upstream_forbidden",
          404: "upstream_not_found", 429: "rate_limit_exceeded"}


def backoff_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """What a provider's error response tells a client to back off by, to relay with the error:
    `retry-after`, `retry-after-ms` (the openai SDKs time their retries by them) and the
    `x-ratelimit-*` headers. No other header of the provider's reaches the client."""
    if not headers:
        return {}
    return {name.lower(): value for name, value in headers.items()
            if name.lower() in ("retry-after", "retry-after-ms") or name.lower().startswith("x-ratelimit-")}


def status_error(status: int | None, message: str, code: Any = None, param: Any = None,
                 headers: Mapping[str, str] | None = None) -> UpstreamError:
    """The error for a provider's HTTP status: its status (502 if it gave none that is an error),
    an OpenAI error type for it, its own error code and the parameter it names where it sent them
    (`"param": "temperature"`), and the headers of its response a client backs off by."""
    answered = status if isinstance(status, int) and 100 <= status <= 599 else None
    if not isinstance(status, int) or not 400 <= status <= 599:
        status = 502
    if not isinstance(code, str) or not code or code.isdigit():
        code = _CODES.get(status, "upstream_error")
    error = UpstreamError(message, status=status, code=code,  # its type: `errors.error_type(upstream=True)`
                          param=param if isinstance(param, str) and param else None)
    error.upstream_status = answered  # for the request's log line
    error.headers = backoff_headers(headers)
    return error


def unreachable(exc: BaseException) -> UpstreamError:
    return UpstreamError(f"upstream unreachable ({failure(exc)})", status=502, code="upstream_unreachable")


def broke_off(exc: BaseException) -> UpstreamError:
    return UpstreamError(f"upstream stream broke off ({failure(exc)})", code="upstream_incomplete")


def failure(exc: BaseException) -> str:
    """What went wrong on the way to the provider, for the client: the error's class and the
    system's words for it ("ClientConnectorError: Connection refused"). Never the error's own text,
    which names the operator's upstream host and port and aiohttp's objects (an SSL context's
    address), or quotes the provider's bytes."""
    os_error = getattr(exc, "os_error", None) or (exc if isinstance(exc, OSError) else None)
    number = getattr(os_error, "errno", None)  # its own words may hold the address (asyncio's do)
    return f"{type(exc).__name__}: {os.strerror(number)}" if isinstance(number, int) else type(exc).__name__


def timed_out(seconds: float) -> UpstreamError:
    return UpstreamError(f"upstream timed out after {seconds:g} s", status=504, code="upstream_timeout")


class OpenAIUpstream:
    """One connection pool for every OpenAI-compatible model; created on first use, in the loop
    that serves requests, and closed with the provider."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[str, str | None] = {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool limit: memproxy never holds more upstream calls than it has requests in flight.
            # Not `trust_env`: it reads the environment and ~/.netrc on every request (0.6-0.8 ms of
            # CPU each here); `_proxy` reads the proxy settings once per base URL instead.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                headers={"User-Agent": f"memproxy/{__version__}"},
            )
        return self._session

    async def complete(self, model: ModelConfig, messages: list[Message], params: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=model.timeout_seconds)
        try:
            async with self._post(model, messages, params, timeout) as response:
                if response.status >= 400:
                    raise await _http_error(response)
                raw = await response.read()
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise timed_out(model.timeout_seconds) from None
        except aiohttp.ClientError as exc:
            raise unreachable(exc) from exc
        result = _json(raw)
        if isinstance(result, dict) and isinstance(result.get("error"), dict):
            raise _error_from(None, result)
        if not isinstance(result, dict) or not isinstance(result.get("choices"), list):
            raise UpstreamError("upstream answered with something that is not a chat completion")
        return result

    async def stream(
        self, model: ModelConfig, messages: list[Message], params: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks as dicts; the response's status and first chunk are awaited before this returns,
        so early errors raise here. A stall between chunks longer than the timeout is a 504."""
        return await self.stream_at(model, "chat/completions", {**params, "stream": True, "messages": messages})

    async def stream_at(
        self, model: ModelConfig, path: str, params: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """`stream` for any endpoint that streams JSON events (`completions`): `params` is the
        body, `stream: true` included."""
        response = await self.open(model, path, params)
        chunks = _chunks(response, model.timeout_seconds)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            response.release()
            raise nothing_streamed() from None
        except BaseException:
            response.release()
            raise
        return _rest(first, chunks, response)

    async def request(self, model: ModelConfig, path: str,
                      body: dict[str, Any] | aiohttp.FormData) -> tuple[bytes, str]:
        """A whole answer from any endpoint at `path` (`embeddings`, `audio/transcriptions`, ...):
        its bytes and content type. `body` is JSON (its `model` replaced by the provider's name for
        it), or a form that names the model already."""
        timeout = aiohttp.ClientTimeout(total=model.timeout_seconds)
        try:
            async with self._send(model, path, body, timeout) as response:
                if response.status >= 400:
                    raise await _http_error(response)
                return await response.read(), response.content_type
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise timed_out(model.timeout_seconds) from None
        except aiohttp.ClientError as exc:
            raise unreachable(exc) from exc

    async def open(self, model: ModelConfig, path: str, params: dict[str, Any]) -> aiohttp.ClientResponse:
        """An answer to read as it comes (events, audio), its status checked: the caller releases
        it. A stall longer than the timeout, before the headers or between reads, is a 504."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=model.timeout_seconds,
                                        sock_read=model.timeout_seconds)
        try:
            response: aiohttp.ClientResponse = await self._send(model, path, params, timeout)
            if response.status >= 400:
                try:
                    raise await _http_error(response)
                finally:
                    response.release()
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise timed_out(model.timeout_seconds) from None
        except aiohttp.ClientError as exc:
            raise unreachable(exc) from exc
        return response

    def _post(self, model: ModelConfig, messages: list[Message], params: dict[str, Any],
              timeout: aiohttp.ClientTimeout) -> Any:
        """The request, to be awaited or used as a context manager."""
        return self._send(model, "chat/completions", {**params, "messages": messages}, timeout)

    def _send(self, model: ModelConfig, path: str, body: dict[str, Any] | aiohttp.FormData,
              timeout: aiohttp.ClientTimeout) -> Any:
        base = model.api_base or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE") \
            or DEFAULT_BASE
        key = model.api_key if model.api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = dict(model.headers)  # the model's own (`models[].headers`), none of them managed below
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data: bytes | aiohttp.FormData
        if isinstance(body, dict):
            # The model the provider knows, where the client named it.
            data = dumps({**body, "model": model_id(model)})
            headers["Content-Type"] = "application/json"
        else:
            data = body
        return self._http().post(f"{base.rstrip('/')}/{path}", data=data, headers=headers, timeout=timeout,
                                 proxy=self._proxy(base))

    def _proxy(self, base: str) -> str | None:
        """The proxy HTTP(S)_PROXY names for this URL unless NO_PROXY exempts it, as litellm's
        clients would use; read once per base URL."""
        if base not in self._proxies:
            url = urllib.parse.urlsplit(base)
            bypass = urllib.request.proxy_bypass(url.hostname or "")
            self._proxies[base] = None if bypass else urllib.request.getproxies_environment().get(url.scheme)
        return self._proxies[base]


def model_id(model: ModelConfig) -> str:
    """The model name the provider knows: litellm's model string without its `openai/` prefix."""
    return model.model[len(PREFIX):] if model.model.startswith(PREFIX) else model.model


# The longest line of a stream memproxy reads: an event is one line, and a chunk may carry a whole
# answer, an image or a clip of audio (aiohttp's own limit, twice its buffer, is 128 KiB).
LONGEST_EVENT = 64 << 20


async def _chunks(response: aiohttp.ClientResponse, timeout: float) -> AsyncGenerator[dict[str, Any], None]:
    """The `data:` events of an SSE body, decoded, up to `[DONE]` or the end of the body."""
    data: list[str] = []
    try:
        while raw := await response.content.readline(max_line_length=LONGEST_EVENT):
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line or not data:
                continue  # comments, event names, ids; or a blank line between events
            payload, data = "\n".join(data), []
            if payload.strip() == "[DONE]":
                return
            chunk = _json(payload.encode())
            if not isinstance(chunk, dict):
                raise UpstreamError("upstream sent a stream event that is not a JSON object")
            if isinstance(chunk.get("error"), dict):
                raise _error_from(None, chunk)
            yield chunk
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        raise timed_out(timeout) from None
    except aiohttp.ClientError as exc:
        raise broke_off(exc) from exc
    except LineTooLong as exc:
        raise UpstreamError(f"upstream sent a stream event longer than {LONGEST_EVENT >> 20} MiB") from exc


def nothing_streamed() -> UpstreamError:
    """A stream that ended before its first event: a 502 before anything is sent, not an empty answer."""
    return UpstreamError("upstream stream ended before its first event", code="upstream_incomplete")


async def _rest(first: dict[str, Any], chunks: AsyncGenerator[dict[str, Any], None],
                response: aiohttp.ClientResponse) -> AsyncGenerator[dict[str, Any], None]:
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    finally:
        response.release()


async def _http_error(response: aiohttp.ClientResponse) -> UpstreamError:
    raw = await response.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return _error_from(response.status, body, response.headers)
    text = raw.decode("utf-8", "replace").strip()[:1000] or response.reason or "no message"
    return status_error(response.status, text, headers=response.headers)


def _error_from(status: int | None, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> UpstreamError:
    error = body["error"]
    message = error.get("message")
    return status_error(status if status is not None else error.get("status") or error.get("code"),
                        message if isinstance(message, str) and message else "upstream error",
                        error.get("code"), error.get("param"), headers)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise UpstreamError("upstream answered with invalid JSON") from None
