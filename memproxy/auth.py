"""Proxy API keys: `Authorization: Bearer <key>` (or Azure OpenAI's `api-key: <key>`) names the caller.

A tenant key scopes everything the caller sees to its tenant; an admin key (`auth.admin_keys`) may
use the session admin API across every tenant but cannot chat. Keys are compared in constant time.
With no keys configured every caller is the tenant `default` (the CLI refuses to bind a non-loopback
address in that case unless told to). The client's key is only ever used here: upstream keys come
from the model config.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .config import AuthConfig
from .errors import Unauthorized

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None for an admin key
    admin: bool = False


def authenticate(auth: AuthConfig, authorization: str | None, api_key: str | None = None) -> Caller:
    """The caller `Authorization: Bearer <key>` names, or, where that header is absent, the
    `api-key` header (`api_key`), which Azure OpenAI's clients send their key in."""
    if not auth.keys and not auth.admin_keys:
        return Caller(DEFAULT_TENANT)
    if authorization is None and api_key is not None:
        token = api_key
    else:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110)
            token = ""
    if not token.strip():
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <proxy key>' (or 'api-key: <proxy key>').")
    # aiohttp decodes a header's bytes as UTF-8 with surrogateescape: what is not UTF-8 (a byte
    # of Latin-1) arrives as a lone surrogate, which only this encoding turns back into its bytes.
    given = token.strip().encode("utf-8", "surrogateescape")
    caller = None
    for key in auth.keys:
        if hmac.compare_digest(given, key.key.encode()):
            caller = Caller(key.tenant)
    for admin_key in auth.admin_keys:
        if hmac.compare_digest(given, admin_key.encode()):
            caller = Caller(None, admin=True)
    if caller is None:
        raise Unauthorized("Incorrect API key provided.")
    return caller
