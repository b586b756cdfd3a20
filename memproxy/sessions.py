"""Session endpoints under `/v1/sessions`, scoped to the caller's tenant.

`POST /v1/sessions/{id}/compact` folds everything but the verbatim tail into the summary now and
returns the summary and token counts. A session of another tenant is a 404, like one that does not
exist: its existence is never confirmed.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .config import ModelConfig
from .errors import BadRequest, NotFound, UpstreamError
from .session_ids import is_session_id
from .typedefs import CONFIG, STORE, SUMMARIZER, TENANT


async def compact(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    tenant = request[TENANT]
    model = _model(request, await _body(request))
    store = request.app[STORE]
    if not is_session_id(session_id) or await store.get_session(tenant, session_id) is None:
        raise NotFound(f"No session '{session_id}'.", code="session_not_found")
    result = await request.app[SUMMARIZER].fold(tenant, session_id, model)
    if result.outcome == "failed":
        raise UpstreamError(f"the summariser failed: {result.detail}", code="summarization_failed")
    summary = result.summary
    return web.json_response({
        "object": "session.compaction",
        "session_id": session_id,
        "outcome": result.outcome,
        "detail": result.detail or None,
        "messages_folded": result.messages_folded,
        "tokens_before": result.tokens_before,
        "tokens_after": result.tokens_after,
        "summary": None if summary is None else {
            "version": summary.version,
            "text": summary.text,
            "covers_messages": summary.covers,
            "tokens": summary.tokens,
            "model": summary.model,
        },
    })


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _model(request: web.Request, body: dict[str, Any]) -> ModelConfig:
    """The model whose window sizes the tail: the one named, else the summariser, else the first."""
    config = request.app[CONFIG]
    name = body.get("model") or config.memory.summarizer_model
    model = config.model(name) if isinstance(name, str) else None
    if model is None and name is None and config.models:
        model = config.models[0]
    if model is None:
        raise NotFound(f"The model '{name}' does not exist on this proxy.", code="model_not_found",
                       param="model")
    return model
