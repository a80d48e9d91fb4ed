"""Optional bearer-token auth for /v1/*; /health, /ready and /metrics stay open (probes and
Prometheus must reach them without the key)."""

from __future__ import annotations

import hmac

# Exact paths, not prefixes: `path.startswith(...)` left every unknown path that begins with
# one open ("/healthz", "/metrics/x", "/docs-internal") answered without the key, where
# docs/server.md has unknown paths ask for it like any other. "/docs/oauth2-redirect" is the
# Swagger UI page /docs loads.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/docs/oauth2-redirect",
                        "/openapi.json", "/redoc"})


def requires_auth(path: str) -> bool:
    # A trailing slash stays open ("/health/" is redirected to "/health", a probe follows it)
    return path.rstrip("/") not in OPEN_PATHS


def is_authorized(authorization: str | None, api_key: str) -> bool:
    """Constant-time check of `Authorization: Bearer <api_key>`."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
