"""Which web pages may call memproxy: a browser's `Origin`, and the `Host` a request names.

A browser sends `Origin` with every request a page makes to another origin, and with a same-origin
one other than GET or HEAD. memproxy answers a page of another origin only where
`server.cors_origins` lists it (or holds "*"); any other is refused with a 403 `origin_not_allowed`
before its body is read. Without that, a page the user merely visits could send a "simple" request
(a POST of `text/plain`, which needs no preflight) that spends the upstream key or changes a
session, even though it could never read the answer. The listed origins get CORS through
aiohttp-cors: preflights answered for any method and any request header (the OpenAI SDKs send their
own `x-stainless-*` ones), no cookies (memproxy takes none), and every response header exposed, so a
page can read `X-Memproxy-*`. No origin is listed by default: a browser app is the one client that
needs the operator to say so.

With no `auth.keys` (a local daemon) every caller is the one tenant, so the `Host` header matters
too. A DNS-rebinding page (the attacker's own domain, resolved to 127.0.0.1 once the page loaded)
is same-origin with memproxy as far as the browser knows, and could read every conversation. Such
a request names that domain in `Host`: without keys memproxy answers only a Host that is an IP
address, `localhost` or a name under `.localhost`, or one `server.allowed_hosts` lists. With keys a
page has nothing to gain: a browser never adds a bearer key by itself.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from .config import Config
from .errors import Forbidden

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guard(config: Config) -> Middleware:
    """The middleware refusing a page's request from an origin not allowed, and, with no keys, a
    Host that is not this machine's."""
    origins = frozenset(config.server.cors_origins)
    any_origin = "*" in origins
    hosts = frozenset(config.server.allowed_hosts)
    keyless = not config.auth.keys and not config.auth.admin_keys

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keyless and not host_allowed(request.host, hosts):
            raise Forbidden("This memproxy has no auth.keys, so it answers only requests that name it by an "
                            "IP address or localhost; add this host name to server.allowed_hosts.",
                            code="host_not_allowed")
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and not any_origin and origin.lower() not in origins \
                and not same_origin(origin, request.host):
            raise Forbidden("Requests from this web page's origin are not allowed; list it in "
                            "server.cors_origins.", code="origin_not_allowed")
        return await handler(request)

    return middleware


def add_cors(app: web.Application, config: Config) -> None:
    """CORS answers for the allowed origins, on every route of `app` (after all are added)."""
    if not config.server.cors_origins:
        return
    import aiohttp_cors  # only for a config that lists origins

    options = aiohttp_cors.ResourceOptions(  # type: ignore[no-untyped-call]
        allow_credentials=False, expose_headers="*", allow_headers="*",
                                           allow_methods="*", max_age=600)
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in config.server.cors_origins})
    for resource in list(app.router.resources()):
        cors.add(resource)


def is_preflight(request: web.Request) -> bool:
    """A browser's CORS preflight: it never carries the key, and is answered without one."""
    return request.method == hdrs.METH_OPTIONS and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers


def same_origin(origin: str, host: str) -> bool:
    """Whether a page's `Origin` names the host (and port) its request was sent to: the inspector's
    own requests. The scheme is not compared: behind a proxy that ends TLS, the page is https and
    memproxy sees http."""
    _, sep, netloc = origin.partition("://")
    return bool(sep) and netloc.lower() == host.lower()


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a `Host` header (with its port, if any) names an IP address, localhost, or an
    allowed name."""
    name = host.lower()
    if name.startswith("["):  # an IPv6 address: [::1]:8080
        name = name[1:name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name == "localhost" or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
