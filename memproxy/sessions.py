"""The session admin API under `/v1/sessions` (and `/v1/usage`), scoped to the caller's tenant.

A tenant key sees its own sessions only; another tenant's session is a 404, exactly like one that
does not exist, so its existence is never confirmed. An admin key (`auth.admin_keys`) sees every
tenant and names one with `?tenant=` where a session is addressed. Metadata values are the agents'
own state: they are stored and returned, never logged. No endpoint takes content in its URL (URLs
are what access logs and proxies write down): new messages travel in request bodies.

The work is done by `memproxy.admin`, which the CLI shares; this module only speaks HTTP.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from . import admin, exports, preview
from .bodies import body_bytes, json_object
from .errors import BadRequest, Forbidden, NotFound, UpstreamError
from .memory.retention import expired_before, has_expired
from .session_ids import end_user, is_session_id
from .store import SessionState
from .typedefs import CALLER, CONFIG, HISTORIES, PROVIDER, STORE, SUMMARIZER


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/sessions", list_sessions)
    r.add_delete("/v1/sessions", delete_all)
    r.add_post("/v1/sessions/import", import_session)
    r.add_get("/v1/sessions/{session_id}", show)
    r.add_delete("/v1/sessions/{session_id}", delete)
    r.add_post("/v1/sessions/{session_id}/clear", clear)
    r.add_post("/v1/sessions/{session_id}/fork", fork)
    r.add_get("/v1/sessions/{session_id}/export", export)
    r.add_get("/v1/sessions/{session_id}/context", context)
    r.add_post("/v1/sessions/{session_id}/context", context)
    r.add_post("/v1/sessions/{session_id}/compact", compact)
    r.add_get("/v1/sessions/{session_id}/metadata", get_metadata)
    r.add_put("/v1/sessions/{session_id}/metadata", put_metadata)
    r.add_patch("/v1/sessions/{session_id}/metadata", patch_metadata)
    r.add_get("/v1/usage", usage)
    r.add_post("/v1/sessions/{session_id}/search", search_session)
    r.add_post("/v1/search", search)


def addressed_tenant(request: web.Request, listing: bool = False) -> str | None:
    """The tenant addressed: the caller's own, or for an admin key the `tenant` parameter (every
    tenant when listing without one). A tenant key naming another tenant is refused: taken as its
    own, `DELETE /v1/sessions?all=true&tenant=b` deleted every session of the caller's tenant."""
    caller = request[CALLER]
    wanted = request.query.get("tenant")
    if not caller.admin:
        if wanted is not None and wanted != caller.tenant:
            raise Forbidden("a tenant key addresses its own tenant only; ?tenant= is for admin keys",
                            param="tenant")
        return caller.tenant
    if wanted is None and not listing:
        raise BadRequest("an admin key must name the session's tenant: ?tenant=...", param="tenant")
    if wanted is not None and not wanted.isprintable():  # a NUL is no name, and PostgreSQL's text refuses it
        raise BadRequest("'tenant' must be a tenant's name", param="tenant")
    return wanted


async def _session(request: web.Request) -> tuple[str, SessionState]:
    tenant = addressed_tenant(request)
    assert tenant is not None
    session_id = request.match_info["session_id"]
    session = await request.app[STORE].get_session(tenant, session_id) if is_session_id(session_id) else None
    if session is None:
        raise _no_session(session_id)
    return tenant, session


def _no_session(session_id: str) -> NotFound:
    return NotFound(f"No session '{session_id}'.", code="session_not_found")


def _expired_before(request: web.Request) -> float | None:
    return expired_before(request.app[CONFIG].retention.idle_ttl_seconds)


async def list_sessions(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "50"))
    except ValueError:
        limit = 0  # refused as out of range by admin.list_sessions
    page = await admin.list_sessions(request.app[STORE], addressed_tenant(request, listing=True), limit,
                                     request.query.get("after"))
    return web.json_response(page)


async def show(request: web.Request) -> web.Response:
    _, session = await _session(request)
    return web.json_response(await admin.show(request.app[STORE], session))


async def delete(request: web.Request) -> web.Response:
    _, session = await _session(request)
    await request.app[STORE].delete_session(session)
    return web.json_response({"id": session.session_id, "object": "session.deleted", "deleted": True})


async def delete_all(request: web.Request) -> web.Response:
    """Every session of one tenant, whatever their clocks say (`?all=true`, so that a DELETE on
    the list by mistake deletes nothing); an admin key names the tenant."""
    if request.query.get("all") != "true":
        raise BadRequest("deleting every session of the tenant needs ?all=true", param="all")
    tenant = addressed_tenant(request)
    assert tenant is not None
    deleted = await request.app[STORE].delete_tenant(tenant)
    return web.json_response({"object": "session.deleted", "tenant": tenant, "deleted": deleted})


async def clear(request: web.Request) -> web.Response:
    _, session = await _session(request)
    if not await request.app[STORE].clear_session(session, _expired_before(request)):
        raise _no_session(session.session_id)
    return web.json_response({"id": session.session_id, "object": "session.cleared", "cleared": True})


async def fork(request: web.Request) -> web.Response:
    tenant, session = await _session(request)
    body = await json_object(request, optional=True)
    new_id = body.get("new_id")
    at = await admin.fork(request.app[STORE], session, tenant, new_id, body.get("at"))
    return web.json_response({"id": new_id, "object": "session", "forked_from": session.session_id,
                              "messages": at}, status=201)


async def export(request: web.Request) -> web.Response:
    _, session = await _session(request)
    records = await request.app[STORE].export_session(session)
    # A long session's export is seconds of work: off the event loop, which serves every other request.
    return web.Response(text=await asyncio.to_thread(exports.to_jsonl, records), content_type="application/x-ndjson")


async def import_session(request: web.Request) -> web.Response:
    tenant = addressed_tenant(request)
    assert tenant is not None
    records = await asyncio.to_thread(exports.from_jsonl, await body_bytes(request))
    # An id asked for is that id, empty or not (an unset shell variable): never the export's instead.
    session_id = request.query["session_id"] if "session_id" in request.query else exports.exported_id(records)
    if not is_session_id(session_id):
        raise BadRequest("'session_id' must be a session id", param="session_id")
    await request.app[STORE].import_session(tenant, session_id, records)
    return web.json_response({"id": session_id, "object": "session", "imported": True}, status=201)


async def context(request: web.Request) -> web.Response:
    """What the next request would send upstream, part by part, with token counts."""
    tenant, session = await _session(request)
    if "message" in request.query or "messages" in request.query:
        # Content in a query string lands in access logs and proxies' logs: it goes in a body.
        raise BadRequest("new messages go in the body of a POST, never in the URL", param="message")
    body = await json_object(request, optional=True) if request.method == "POST" else {}
    app = request.app
    model = await admin.session_model(app[STORE], app[CONFIG], session,
                                      body.get("model") or request.query.get("model"))
    planned = await preview.context(app[STORE], app[SUMMARIZER], app[PROVIDER], app[CONFIG], model,
                                    tenant, session, body.get("messages", []), body,
                                    end_user(request.headers, body), app[HISTORIES])
    return web.json_response(planned)


def _no_query_in_url(request: web.Request) -> None:
    if "query" in request.query or "q" in request.query:
        # A query names what was said: like content, it stays out of URLs and the logs they land in.
        raise BadRequest("the search query goes in the body of the POST, never in the URL", param="query")


async def search_session(request: web.Request) -> web.Response:
    """The session's stored messages that match `query`, best first."""
    _no_query_in_url(request)
    tenant, session = await _session(request)
    body = await json_object(request)
    since = expired_before(request.app[CONFIG].retention.idle_ttl_seconds)
    return web.json_response(await admin.search(request.app[STORE], tenant, body, session, since))


async def search(request: web.Request) -> web.Response:
    """Stored messages of every session the caller may see that match `query`, best first."""
    _no_query_in_url(request)
    body = await json_object(request)
    since = expired_before(request.app[CONFIG].retention.idle_ttl_seconds)
    return web.json_response(await admin.search(request.app[STORE], addressed_tenant(request, listing=True), body,
                                                active_since=since))


async def compact(request: web.Request) -> web.Response:
    tenant, session = await _session(request)
    model = await admin.session_model(request.app[STORE], request.app[CONFIG], session,
                                      (await json_object(request, optional=True)).get("model"))
    result = await request.app[SUMMARIZER].fold(tenant, session.session_id, model)
    if result.outcome == "failed":
        raise UpstreamError(f"the summariser failed: {result.detail}", code="summarization_failed")
    return web.json_response(admin.compaction(session.session_id, result))


async def get_metadata(request: web.Request) -> web.Response:
    _, session = await _session(request)
    if has_expired(session, request.app[CONFIG].retention.idle_ttl_seconds):
        return web.json_response({})  # what it held is gone for every other purpose too
    return web.json_response(await request.app[STORE].get_metadata(session))


async def put_metadata(request: web.Request) -> web.Response:
    """Replace the metadata; creates the session if needed, so an agent can set state first."""
    tenant = addressed_tenant(request)
    assert tenant is not None
    session_id = request.match_info["session_id"]
    if not is_session_id(session_id):
        raise BadRequest("not a session id", param="session_id")
    metadata = await json_object(request)  # an empty body says nothing: it never clears the metadata
    await request.app[STORE].set_metadata(tenant, session_id, metadata, _expired_before(request))
    return web.json_response(metadata)


async def patch_metadata(request: web.Request) -> web.Response:
    """Merge the given top-level keys into the metadata; a key set to null is removed."""
    _, session = await _session(request)
    changes = await json_object(request, optional=True)
    merged = await request.app[STORE].merge_metadata(session.tenant, session.session_id, changes,
                                                     _expired_before(request))
    if merged is None:
        raise _no_session(session.session_id)
    return web.json_response(merged)


async def usage(request: web.Request) -> web.Response:
    return web.json_response(await admin.usage(request.app[STORE], addressed_tenant(request, listing=True)))
