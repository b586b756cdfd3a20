"""Read deadlines: a slow client cannot hold a connection (and its file descriptor) open.

Three limits, each configurable under `server:`:

- `keepalive_timeout_seconds`: aiohttp's own keep-alive timer. It runs from the moment a connection
  opens and from the end of each response; if no complete request has arrived when it fires, aiohttp
  closes the connection (an idle keep-alive, or a client that never sends anything).
- `header_timeout_seconds`: from the first byte of a request to the end of its headers. aiohttp has
  no such limit, and its parser sees nothing but bytes, so the deadline lives in a thin protocol
  wrapped around aiohttp's (`DeadlinedConnection`, built by `protocols`; the serving code passes it
  to `loop.create_server` in place of aiohttp's `web.Server`, the low-level server's documented use).
  The wrapper forwards every event unchanged; it arms a timer on the first byte received between
  requests, and `header_deadline` (the middleware, which a request reaches once its headers are
  parsed) disarms it. On expiry the client gets a 408 with an OpenAI-shaped body and the connection
  is closed. A request whose headers are parsed before their byte arrives between two requests (a
  pipelined one) is bounded by the keep-alive timer instead.
- `body_timeout_seconds`: from the end of the headers to the end of the body. `body_deadline`, after
  authentication, reads the whole body under this deadline (aiohttp keeps it for the handler's own
  `read()`); on expiry the client gets a 408 and the connection is closed, before anything is
  stored or sent upstream.
  aiohttp reads and drops what the client still sends after the 408 (a "lingering close", so the
  client can read the answer before the socket goes), and the wrapper ends that after
  `_LINGER_SECONDS`, where aiohttp alone would wait 10 s.

All three are wall-clock limits on the whole phase, not on the gap between two bytes: a client
trickling a byte a second is held no longer than one that sends nothing.

And one on the answer: `send_timeout_seconds`. A client that stops reading an answer (a stream
above all) leaves memproxy waiting to write, with the turn's session lock, the upstream connection
and what was read of the answer held, for as long as the connection stays open. `send_deadline`,
run as each response starts, drops the connection once writing has waited that long without the
client taking any of it (the writer paused at every check, `_SEND_CHECKS` a period); the handler's
write then fails as when a client goes away (a stream is not recorded, as any answer the client
did not get whole).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web

from .bodies import body_bytes
from .errors import error_body
from .observe import notes
from .typedefs import CONFIG

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_LINGER_SECONDS = 1.0  # after a 408 for a late body: time for the client to read it before the close
_SEND_CHECKS = 4  # checks of a response's writer per `send_timeout_seconds`


async def send_deadline(request: web.Request, response: web.StreamResponse) -> None:
    """Drops the connection of a response whose client has taken nothing of it for
    `send_timeout_seconds` (an `on_response_prepare` signal: every response, streamed or not). A
    timer checks the connection a few times a period while the task answering this request runs
    (the one preparing the response: `request.task` is the connection's, which outlives each of
    its keep-alive requests); nothing is added to each write.

    The timer is cancelled as that task ends. Left to find the task done at its next check, it kept
    the finished task alive until then (up to a `step`, 15 s by default), and with it the request,
    its body and the answer: at 250 requests a second, some 3,700 finished requests at any time."""
    transport, protocol = request.transport, request.protocol
    task = asyncio.current_task()
    if transport is None or task is None:
        return
    limit = request.app[CONFIG].server.send_timeout_seconds
    step = limit / _SEND_CHECKS
    loop = asyncio.get_running_loop()
    since: float | None = None
    timer: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal since, timer
        if task.done() or transport.is_closing():
            return
        if not protocol.writing_paused:
            since = None
        elif since is None:
            since = loop.time()
        elif loop.time() - since >= limit - step / 2:
            transport.abort()  # the waiting write raises ConnectionResetError: the client is gone
            return
        timer = loop.call_later(step, check)

    def stop(_: asyncio.Task[object]) -> None:
        if timer is not None:
            timer.cancel()

    timer = loop.call_later(step, check)
    task.add_done_callback(stop)


def _timeout_body(what: str, limit: float) -> bytes:
    message = f"The request's {what} did not arrive within {limit:g} seconds."
    return json.dumps(error_body(message, "invalid_request_error", "request_timeout")).encode()


class DeadlinedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline on each request's headers."""

    def __init__(self, inner: asyncio.Protocol, header_timeout: float) -> None:
        self._inner = inner
        self._header_timeout = header_timeout
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._between_requests = True  # the next byte received starts a request's headers
        self._closing = False  # a 408 went out: no more requests on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport, though not necessarily `asyncio.Transport`'s subclass (uvloop's is not)
        self._transport = cast(asyncio.Transport, transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if data and self._between_requests and self._timer is None and not self._closing:
            self._timer = asyncio.get_running_loop().call_later(self._header_timeout, self._expire)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def request_started(self) -> None:
        """The request's headers are parsed: its body and answer are no business of this timer."""
        self._between_requests = False
        self._disarm()

    def request_finished(self) -> None:
        self._between_requests = True

    def close_soon(self) -> None:
        """The answer is a 408 for a late body: close once the client has had time to read it."""
        self._closing = True
        self._disarm()
        transport = self._transport
        if transport is not None:
            asyncio.get_running_loop().call_later(_LINGER_SECONDS, transport.close)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing() or not self._between_requests:
            return
        body = _timeout_body("headers", self._header_timeout)
        transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        transport.close()


def protocols(server: Callable[[], asyncio.Protocol], header_timeout: float) -> Callable[[], DeadlinedConnection]:
    """The protocol factory for `loop.create_server`: aiohttp's `server` (a `web.Server`, which makes
    one protocol per connection), each wrapped with the header deadline."""
    return lambda: DeadlinedConnection(server(), header_timeout)


def _connection(request: web.Request) -> DeadlinedConnection | None:
    """The request's connection, where it has a header deadline (not in an in-process test server)."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    return connection if isinstance(connection, DeadlinedConnection) else None


@web.middleware
async def header_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Stops the header deadline: the headers are in."""
    connection = _connection(request)
    if connection is not None:
        connection.request_started()
    try:
        return await handler(request)
    finally:
        if connection is not None:
            connection.request_finished()


@web.middleware
async def body_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Reads the body within its deadline. It comes after authentication: a caller without a key
    is answered before a byte of its body is read, so it cannot make the server hold
    `server.max_body_bytes` per connection for the body's deadline."""
    if request.body_exists:
        limit = request.app[CONFIG].server.body_timeout_seconds
        try:
            async with asyncio.timeout(limit):
                await body_bytes(request)  # a body that fails to decode: a 400, as the handler's would be
        except TimeoutError:
            notes(request).error = "request_timeout"
            response = web.Response(body=_timeout_body("body", limit), status=408,
                                    content_type="application/json")
            response.force_close()  # the rest of the body is not worth waiting for
            connection = _connection(request)
            if connection is not None:
                connection.close_soon()
            return response
    return await handler(request)
