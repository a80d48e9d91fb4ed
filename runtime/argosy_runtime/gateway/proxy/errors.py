"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

The same shape, types and codes the runtime server uses (argosy_runtime.server.errors), so
clients cannot tell whether the gateway or a replica refused a request. Errors a replica
produces (validation of sampling fields, unknown fields, context length) are passed through
unchanged; the gateway only answers itself what it must decide before choosing a replica.
"""

from __future__ import annotations

import contextlib
import json
import math

from aiohttp import web

# What `json.loads` of a client's body raises when the body is not JSON the gateway can read:
# invalid UTF-8 and invalid JSON (UnicodeDecodeError, JSONDecodeError), an integer of more
# than 4300 digits (a plain ValueError: Python's int-from-string limit, CVE-2020-10735), or
# arrays/objects nested deeper than Python's recursion limit (a few kB of "[" raise
# RecursionError), all the client's mistake: a 400, never a 500.
MALFORMED_JSON = (ValueError, RecursionError)

# HTTP status -> OpenAI error type, as the runtime server maps them.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
    504: "timeout_error",
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
    err_type = TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}},
        status=status,
        headers=headers,
    )


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, param=param)


def malformed_json(exc: Exception) -> web.Response:
    """The 400 for a body `json.loads` refused with `exc` (one of MALFORMED_JSON)."""
    if type(exc) is ValueError:  # the digit limit: its text tells how to raise it in Python
        return bad_request("malformed JSON body: a number has more digits than this gateway "
                           "reads (4300)")
    return bad_request(f"malformed JSON body: {exc}")


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


def retry_after_value(seconds: float) -> str:
    """A `Retry-After` value for a wait of `seconds`: whole seconds, rounded up (a client
    that retries after a rounded-down wait finds the replicas still cooling down and gets
    another 429), at least 1."""
    return str(max(1, math.ceil(seconds)))


def no_replica(model: str, retry_after: float | None = None) -> web.Response:
    """503 when no replica of `model` is in rotation (429 with Retry-After when all are full)."""
    if retry_after is not None:
        return error_response(
            429,
            f"all replicas of {model!r} are busy; retry later",
            headers={"Retry-After": retry_after_value(retry_after)},
        )
    return error_response(503, f"no replica of {model!r} is available")


def is_openai_error(body: bytes) -> bool:
    """Whether a replica's error answer is already `{"error": {...}}` (the runtime server's)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def replica_error(status: int, url: str, body: bytes, headers: dict[str, str]) -> web.Response:
    """A replica's 5xx (or 429) whose body is not an OpenAI error (a proxy's HTML page,
    uvicorn's bare "Internal Server Error"), as one: the same status and headers, a message
    naming the replica and quoting the start of what it said."""
    said = body[:200].decode("utf-8", "replace").strip()
    return error_response(
        status, f"replica {url} answered HTTP {status}" + (f": {said}" if said else ""),
        headers=headers)


async def end_stream_with_error(out: web.StreamResponse, relayed: bytes, url: str) -> None:
    """Write the SSE error event that ends a stream whose replica failed mid-answer (its
    bytes already reached the client, so nothing can be retried), where it can go: when the
    stream relayed so far (`relayed`: its last bytes) ends between two events. The runtime
    server ends its own broken streams with such an event, and the openai client raises it
    as an APIError. The caller then cuts the connection, so the answer never looks whole."""
    if not relayed.endswith((b"\n\n", b"\r\n\r\n")):
        return  # mid-event: one more would merge into the half-sent one
    error = {"message": f"replica {url} failed mid-stream; this answer is incomplete",
             "type": TYPES[502], "param": None, "code": None}
    with contextlib.suppress(ConnectionResetError):  # the client may be gone as well
        await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
