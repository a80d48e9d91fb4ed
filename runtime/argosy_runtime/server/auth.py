"""Optional bearer-token auth for /v1/*; /health, /ready and /metrics stay open (probes and
Prometheus must reach them without the key)."""

from __future__ import annotations

import hmac

OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json", "/redoc")


def requires_auth(path: str) -> bool:
    return not path.startswith(OPEN_PATHS)


def is_authorized(authorization: str | None, api_key: str) -> bool:
    """Constant-time check of `Authorization: Bearer <api_key>`."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
