"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}`.

Bad input is always a 4xx: FastAPI's validation errors (422 by default) become 400 with the
offending field in `param`, malformed JSON is a 400, unknown routes 404, wrong methods 405.
An unexpected exception is logged with its traceback and answered 500 without leaking it.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("argosy.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_from_value_error(message: str) -> str | None:
    """`SamplingParams` messages start with the field name: 'top_p must be ...',
    'structured_outputs.regex: ...'. Field names are lower case: a message that starts with
    a word ('LoRA adapter 'x': ...') names none."""
    first = message.split(" ", 1)[0].strip("'\"").rstrip(":")
    name = first.replace("_", "").replace("[", "").replace("]", "").replace(".", "")
    return first if name.isalnum() and first == first.lower() else None


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    if loc and loc[0] in ("query", "path", "header", "cookie"):
        loc = loc[1:]  # a query parameter is named as itself ('limit'), as a body field is
    parts = [str(p) for p in loc if p != "body"]
    # pydantic reports each member of a union separately (e.g. 'prompt.str'); keep the field
    return parts[0] if parts else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if first.get("type") == "missing" and param is None:
        return "request body is required", None
    where = ".".join(str(p) for p in loc if p != "body") or "body"
    message = f"{where}: {first.get('msg', 'invalid value')}"
    tags = _union_tags(errors, param)
    if len(tags) > 1:  # a union field: name the accepted forms, not the first one's failure
        message = f"{param}: expected one of {' | '.join(tags)}"
        errors = [e for e in errors if _loc_to_param(tuple(e.get("loc", ()))) != param] + [first]
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {where!r}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def _union_tags(errors: list[Any], param: str | None) -> list[str]:
    """pydantic reports a failed union member by member: loc = (body, field, 'str', ...)."""
    tags: list[str] = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if len(loc) >= 2 and loc[0] == param and not loc[1].isdigit() and (
                loc[1] in ("str", "int", "float", "bool", "none") or "[" in loc[1]
                or loc[1][:1].isupper()):
            if loc[1] not in tags:
                tags.append(loc[1])
    return tags


def install_error_handlers(app: FastAPI) -> None:
    """Make every error path answer with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(error_body(detail, _TYPES.get(status, "invalid_request_error")),
                            status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal_server_error"),
                            status_code=500)
