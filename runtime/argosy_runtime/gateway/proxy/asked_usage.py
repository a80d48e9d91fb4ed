"""Asking replicas for the usage of streamed answers on the client's behalf.

A tenant's token limit charges each answer its tokens. A stream reports them only when the
client asked (`stream_options.include_usage`); otherwise the meter estimates one token per
content chunk (tenants/usage.py), which undercounts chunks of several tokens: a speculative
step's accepted drafts, a streamed beam search's whole beams. So when the answer is metered,
the gateway asks for the usage itself on a streamed completion or chat that did not, and
removes that final usage event (a chunk with `choices: []`) from what the client gets: the
client did not ask for it, and code reading `chunk.choices[0]` breaks on it.
"""

from __future__ import annotations

import json
import re
from typing import Any

STREAMED_GENERATIONS = ("/v1/completions", "/v1/chat/completions")


def ask_for_usage(path: str, body: dict[str, Any]) -> bool:
    """Set `stream_options.include_usage` on a streamed completion or chat that lacks it;
    True when `body` changed. A malformed `stream_options` is left for the replica's 400."""
    if path not in STREAMED_GENERATIONS or body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if options is None:
        body["stream_options"] = {"include_usage": True}
        return True
    if isinstance(options, dict) and options.get("include_usage") in (None, False):
        body["stream_options"] = {**options, "include_usage": True}
        return True
    return False


class UsageEventRemover:
    """Passes an event stream on without its usage-only event (and that event's blank
    separator line). Whole lines only: the part of a line not ended yet waits for its end
    (`rest` gives it back when the stream ends without one)."""

    def __init__(self) -> None:
        self._line = b""  # the unfinished last line
        self._drop_separator = False  # the line before was the usage event

    def __call__(self, chunk: bytes) -> bytes:
        *lines, self._line = (self._line + chunk).split(b"\n")
        out = []
        for line in lines:
            if self._drop_separator and not line.strip():
                self._drop_separator = False
                continue
            self._drop_separator = _is_usage_event(line)
            if not self._drop_separator:
                out.append(line + b"\n")
        return b"".join(out)

    def rest(self) -> bytes:
        rest, self._line = self._line, b""
        return rest


# An empty `choices` array, with any JSON whitespace: with include_usage every chunk carries
# `"usage"` (null until the last), so only lines with this are parsed (the meter parses every
# line already; parsing each one again here would double that work per chunk).
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def _is_usage_event(line: bytes) -> bool:
    """`data: {..., "choices": [], "usage": {...}}`: the chunk include_usage adds."""
    if not line.startswith(b"data:") or not _EMPTY_CHOICES.search(line):
        return False
    try:
        event = json.loads(line[5:])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(event, dict) and event.get("choices") == [] and "usage" in event
