"""Reading a batch's input file: one request per line, checked before any of them runs.

A line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
Problems with the file itself (bad JSON, a missing or repeated custom_id, another endpoint)
fail the whole batch before it starts, listed by line number the way OpenAI reports them; a
body the endpoint rejects is that request's error, in the batch's error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argosy_runtime.server.request_body import loads_strict

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
             "/v1/score", "/v1/rerank", "/v1/classify")
MAX_REQUESTS = 50_000  # OpenAI's limit per batch
MAX_ERRORS_LISTED = 100


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line number in the input file
    custom_id: str
    body: dict[str, Any]


def read_batch_input(path: Path, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The requests of an input file, or the errors that make it unusable (OpenAI's shape:
    `{"code", "message", "line", "param"}`)."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def error(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS_LISTED:
            errors.append({"code": code, "message": message, "line": line, "param": param})

    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                item = _parse_line(raw)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError among them
                error("invalid_json_line", f"line is not valid JSON: {exc}", number)
                continue
            except RecursionError:
                error("invalid_json_line", "line is not valid JSON: it is nested too deeply",
                      number)
                continue
            if not isinstance(item, dict):
                error("invalid_json_line", "each line must be a JSON object", number)
                continue
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                error("missing_required_parameter", "custom_id must be a non-empty string",
                      number, "custom_id")
            elif custom_id in seen:
                error("duplicate_custom_id", f"custom_id {custom_id!r} is used twice; each "
                      "request needs its own", number, "custom_id")
            seen.add(custom_id if isinstance(custom_id, str) else "")
            if item.get("method") != "POST":
                error("invalid_method", f"method must be 'POST', got {item.get('method')!r}",
                      number, "method")
            if item.get("url") != endpoint:
                error("mismatched_endpoint", f"url {item.get('url')!r} differs from the "
                      f"batch's endpoint {endpoint!r}", number, "url")
            body = item.get("body")
            if not isinstance(body, dict):
                error("invalid_body", "body must be a JSON object (the request)", number, "body")
            elif body.get("stream"):
                error("invalid_body", "stream is not supported in a batch", number, "body.stream")
            elif body.get("background"):  # the batch would record only the queued response
                error("invalid_body", "background is not supported in a batch (a batch runs "
                      "in the background already)", number, "body.background")
            unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
            if unknown:
                error("invalid_request", f"unknown fields: {', '.join(unknown)}", number,
                      unknown[0])
            if not errors:
                lines.append(BatchLine(number, custom_id, body))  # type: ignore[arg-type]
    if not lines and not errors:
        error("empty_file", "the input file has no requests", None)
    if len(lines) > MAX_REQUESTS:
        error("too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests, this "
              f"file has {len(lines)}", None)
    return ([] if errors else lines), errors


def _parse_line(raw: bytes) -> Any:
    """A line's JSON value, refusing what the runner could not send on as a request (httpx
    encodes strictly) or write to the result files: NaN and Infinity, which Python's json reads
    but JSON does not have, and a lone UTF-16 surrogate (`loads_strict`), which is not
    Unicode. Either used to pass here and make its request vanish without a result."""
    if b"NaN" in raw or b"Infinity" in raw:  # a cheap look first: most lines have neither
        json.loads(raw, parse_constant=_not_json)
    return loads_strict(raw)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")
