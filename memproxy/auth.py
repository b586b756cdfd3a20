"""Proxy API keys: `Authorization: Bearer <key>` names the caller's tenant.

Keys are compared in constant time. With no keys configured every caller is the tenant `default`
(the CLI refuses to bind a non-loopback address in that case unless told to). The client's key is
only ever used here: upstream keys come from the model config.
"""

from __future__ import annotations

import hmac

from .config import AuthConfig
from .errors import Unauthorized

DEFAULT_TENANT = "default"


def authenticate(auth: AuthConfig, header: str | None) -> str:
    if not auth.keys:
        return DEFAULT_TENANT
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():  # the scheme is case-insensitive (RFC 9110)
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <proxy key>'.")
    given = token.strip().encode()
    tenant = None
    for key in auth.keys:
        if hmac.compare_digest(given, key.key.encode()):
            tenant = key.tenant
    if tenant is None:
        raise Unauthorized("Incorrect API key provided.")
    return tenant
