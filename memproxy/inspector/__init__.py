"""The web inspector at `/ui/`: static pages that read the session admin API, nothing else.

The pages themselves hold no data and need no key (the auth middleware covers the API: `/v1/`, and
the OpenAI paths without it): the script asks for a proxy or admin key, keeps it in sessionStorage
and sends it as `Authorization: Bearer` on every `/v1/` call, so what a key sees in the inspector is
exactly what it sees through the JSON API, tenant scope included. No cookie carries the key, so
there is no CSRF surface. Every page is sent with a strict Content-Security-Policy (scripts, styles
and requests from this origin only, no inline code, no framing): content is put on the page as text
by the script, and the policy is the second wall should that ever slip. Serving the files imports
nothing heavy (no litellm).
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new release's script is fetched again, never mixed with an old page
}
FILES = {  # URL name -> (file in this package, content type)
    "": ("index.html", "text/html"),
    "app.js": ("app.js", "text/javascript"),
    "style.css": ("style.css", "text/css"),
}


def add_routes(app: web.Application) -> None:
    # Read once, when the app is built: three small files that ship in the package.
    package = resources.files(__name__)
    pages = {name: (package.joinpath(file).read_bytes(), kind) for name, (file, kind) in FILES.items()}

    async def page(request: web.Request) -> web.Response:
        found = pages.get(request.match_info.get("name", ""))
        if found is None:
            raise web.HTTPNotFound()
        body, kind = found
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=HEADERS)

    async def to_index(request: web.Request) -> web.Response:
        raise web.HTTPFound("ui/")  # relative, as the script's API calls are: a path prefix stays

    app.router.add_get("/ui", to_index)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/{name}", page)
