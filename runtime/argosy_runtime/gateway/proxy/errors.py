"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

The same shape the runtime server uses, so clients cannot tell whether the gateway or a
replica refused a request.
"""

from __future__ import annotations

from aiohttp import web


def error_response(
    status: int,
    message: str,
    err_type: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON error with the given HTTP status; `code` is the status, as the server sends it."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status=status,
        headers=headers,
    )


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, "BadRequestError", param=param)


def model_not_found(model: str) -> web.Response:
    return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", param="model")


def no_replica(model: str, retry_after: float | None = None) -> web.Response:
    """503 when no replica of `model` is in rotation (429 with Retry-After when all are full)."""
    if retry_after is not None:
        return error_response(
            429,
            f"All replicas of `{model}` are busy; retry later.",
            "RateLimitError",
            headers={"Retry-After": str(max(1, round(retry_after)))},
        )
    return error_response(
        503, f"No replica of `{model}` is available.", "ServiceUnavailableError"
    )
