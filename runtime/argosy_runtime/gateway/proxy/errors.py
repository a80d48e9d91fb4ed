"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

The same shape, types and codes the runtime server uses (argosy_runtime.server.errors), so
clients cannot tell whether the gateway or a replica refused a request. Errors a replica
produces (validation of sampling fields, unknown fields, context length) are passed through
unchanged; the gateway only answers itself what it must decide before choosing a replica.
"""

from __future__ import annotations

from aiohttp import web

# HTTP status -> OpenAI error type, as the runtime server maps them.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON error with the given HTTP status."""
    err_type = TYPES.get(status, "invalid_request_error")
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}},
        status=status,
        headers=headers,
    )


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, param=param)


def invalid_api_key() -> web.Response:
    """401 for a missing or unknown key, as the runtime server answers it (the key presented
    is never echoed)."""
    return error_response(401, "invalid or missing API key", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str, served: list[str]) -> web.Response:
    names = ", ".join(repr(s) for s in served)
    return error_response(
        404,
        f"model {model!r} does not exist; this gateway serves {names}",
        param="model",
        code="model_not_found",
    )


def no_replica(model: str, retry_after: float | None = None) -> web.Response:
    """503 when no replica of `model` is in rotation (429 with Retry-After when all are full)."""
    if retry_after is not None:
        return error_response(
            429,
            f"all replicas of {model!r} are busy; retry later",
            headers={"Retry-After": str(max(1, round(retry_after)))},
        )
    return error_response(503, f"no replica of {model!r} is available")
