"""JSON request bodies that hold only valid Unicode.

JSON may spell a UTF-16 surrogate as an escape (`"\\ud83d"`); Python's `json` decodes a lone
one into a `str` that no UTF-8 codec, tokenizer or log line can take (the tokenizer raises
`TypeError`, which used to be a 500 and cut the keep-alive connection). Every route of the
app parses its body through `StrictJSONRoute`, so such a body is a 400 "malformed JSON body"
like any other invalid JSON, before a handler sees it.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

# An escape can put a surrogate in a decoded string. A match may be a false alarm (an escaped
# backslash before "ud83d", or a valid pair), so the decoded value is then searched for a
# lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")
# So can raw surrogate bytes (ED A0..BF: invalid UTF-8, but json.loads decodes bytes with
# "surrogatepass"). 0xED is never a continuation byte, so a match is always one.
_SURROGATE_UTF8_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def loads_strict(body: bytes) -> Any:
    """`json.loads`, raising `json.JSONDecodeError` for a string holding a lone surrogate,
    and for the bodies `json.loads` refuses with another error (FastAPI answers those with a
    bare "There was an error parsing the body", naming no cause)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        raise
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(
            f"the body is not valid {exc.encoding} ({exc.reason} at byte {exc.start})",
            "", 0) from exc
    except ValueError as exc:
        # The only other ValueError of json.loads: an integer literal longer than Python's
        # int-string conversion limit (a guard against quadratic-time parsing).
        raise json.JSONDecodeError(
            f"number too large: an integer has more than {sys.get_int_max_str_digits()} "
            "digits", "", 0) from exc
    except RecursionError as exc:
        raise json.JSONDecodeError("the body is nested too deeply", "", 0) from exc
    encoding = json.detect_encoding(body)
    raw = _SURROGATE_UTF8_BYTES.search(body) if encoding.startswith("utf-8") else None
    if raw is not None:
        raise json.JSONDecodeError(
            f"the body is not valid utf-8 (a UTF-16 surrogate encoded at byte {raw.start()})",
            "", 0)
    suspect = (_SURROGATE_ESCAPE_BYTES.search(body) if encoding == "utf-8"
               else _SURROGATE_ESCAPE.search(body.decode(encoding, "surrogatepass")))
    if suspect is not None:
        where = _find_lone_surrogate(value, "body")
        if where is not None:
            path, char = where
            raise json.JSONDecodeError(
                f"{path} holds a lone UTF-16 surrogate {ascii(char)[1:-1]} (surrogates must "
                "come in pairs: it is not valid Unicode)", body.decode("latin-1"), suspect.start())
    return value


def _find_lone_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """(where, the surrogate) of the first string (or object key) with a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:  # iterative: JSON nests deeper than Python's recursion limit allows
        item, where = stack.pop()
        if isinstance(item, str):
            found = _LONE_SURROGATE.search(item)
            if found:
                return where, found.group()
        elif isinstance(item, dict):
            for key, sub in item.items():
                found = _LONE_SURROGATE.search(key)
                if found:
                    return f"{where} key", found.group()
                stack.append((sub, f"{where}.{key}" if where != "body" else key))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(item))
    return None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An `APIRoute` whose JSON body goes through `loads_strict` (FastAPI turns its
    `JSONDecodeError` into the usual 400 `json_invalid` validation error)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
