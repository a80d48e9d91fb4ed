"""The HTTP layer's bearer auth: which paths are open, and keys as deployments pass them.

In process (RequestContextMiddleware around a stub app): no model, no server to start.
"""

from __future__ import annotations

import pytest
from argosy_runtime.server.config import ServerConfig
from argosy_runtime.server.request_log import RequestContextMiddleware
from starlette.testclient import TestClient
from starlette.types import Receive, Scope, Send


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _client(api_key: str | None) -> TestClient:
    # Not entered as a context manager: that would run a lifespan the stub does not serve
    return TestClient(RequestContextMiddleware(_ok, api_key=api_key))


def test_an_api_key_from_a_secret_file_with_a_newline_still_authorizes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `kubectl create secret --from-file` keeps the file's final newline; no client can send
    # it back (header values carry no surrounding whitespace): it was a 401 for everyone.
    monkeypatch.setenv("ARGOSY_API_KEY", "s3cret\n")
    config = ServerConfig(api_key=ServerConfig.api_key_from_env(None))
    c = _client(config.api_key)
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
    assert ServerConfig(api_key="  s3cret ").api_key == "s3cret"  # --api-key, the same
    with pytest.raises(ValueError, match="ASCII"):  # it could never match a header either
        ServerConfig(api_key="clé")


@pytest.mark.parametrize("path", ["/healthz", "/metrics/x", "/ready-now", "/docs-internal",
                                  "/openapi.json.bak", "/redocs"])
def test_unknown_paths_that_start_like_an_open_one_need_the_key(path: str) -> None:
    r = _client("k").get(path)
    assert r.status_code == 401, path
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/docs", "/openapi.json",
                                  "/redoc", "/docs/oauth2-redirect", "/health/"])
def test_probes_and_the_schema_stay_open(path: str) -> None:
    assert _client("k").get(path).status_code == 200, path


def test_a_client_that_leaves_mid_body_is_counted_499_not_400() -> None:
    """The app's real middleware stack and JSON route, a body cut by a disconnect."""
    import asyncio

    from argosy_runtime.server.body_limit import BodySizeLimitMiddleware
    from argosy_runtime.server.errors import install_error_handlers
    from argosy_runtime.server.request_body import StrictJSONRoute
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Body(BaseModel):
        prompt: str

    app = FastAPI()
    app.router.route_class = StrictJSONRoute
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: Body) -> dict[str, str]:
        return {"prompt": body.prompt}

    seen: list[tuple[str, int]] = []
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=1 << 20)
    app.add_middleware(RequestContextMiddleware, on_response=lambda p, s: seen.append((p, s)))
    messages = [{"type": "http.request", "body": b'{"prompt": "Once upon', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Event().wait()

    async def send(message) -> None:
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    assert seen == [("/v1/completions", 499)]
