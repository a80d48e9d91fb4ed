"""How many tokens an answer used, read from the bytes the gateway relays (it has no
tokenizer).

- A non-streamed answer carries `usage` in its JSON body (`prompt_tokens` /
  `completion_tokens`; `input_tokens` / `output_tokens` on the Responses API; only
  `prompt_tokens` on embeddings, which generate nothing).
- A stream carries it in its usage chunk when the client asked for
  `stream_options.include_usage` (the Responses API always sends it, in its
  `response.completed` event). Without it the gateway estimates: one token per content chunk
  relayed, answer or reasoning (a replica sends one chunk per decode step, about a token
  each) plus the prompt's length in characters / 4, rounded up (about 4 characters a token
  for English text).
- An error answer (4xx, 5xx) used no tokens.

The meter reads a copy of each chunk after it was relayed; the relay itself is never delayed
or buffered by it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4  # the prompt estimate's rule of thumb
MAX_JSON_BYTES = 16 * 1024 * 1024  # a non-streamed body larger than this is estimated
MAX_LINE_BYTES = 1024 * 1024  # an SSE line longer than this is skipped, not buffered whole


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


NO_USAGE = Usage(0, 0)


def usage_of(answer: Any) -> Usage | None:
    """The usage in a chat/completions or embeddings answer or stream chunk, or in a
    Responses API object or stream event (under `response`); None when it has none."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if usage is None and isinstance(answer.get("response"), dict):
        usage = answer["response"].get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if prompt is None and not {"completion_tokens", "output_tokens"} & usage.keys():
        prompt = usage.get("total_tokens")  # vLLM's rerank answers say only this: all input
    # An embeddings answer reports only `prompt_tokens` (and `total_tokens`): it generated
    # nothing, so its completion tokens are 0 and the tenant pays for its inputs alone.
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
               for n in (prompt, completion)):
        return None
    return Usage(prompt, completion)


def estimate(prompt_chars: int, content_chunks: int) -> Usage:
    """The estimate for an answer without usage (see the module docstring)."""
    return Usage(math.ceil(prompt_chars / CHARS_PER_TOKEN), content_chunks, estimated=True)


def _is_content(event: Any) -> bool:
    """An SSE event that carries generated text, the answer's or its reasoning (not a
    role-only, finish or usage chunk)."""
    if not isinstance(event, dict):
        return False
    if str(event.get("type", "")).endswith(".delta"):  # the Responses API's deltas
        return True
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        # `reasoning_content`: a reasoning model's thinking (the runtime's --reasoning-parser),
        # generated tokens like the answer's, often most of them.
        if (choice.get("text") or delta.get("content") or delta.get("tool_calls")
                or delta.get("reasoning_content")):
            return True
    return False


class UsageMeter:
    """Reads one answer's bytes as they are relayed; `result()` is its usage so far."""

    def __init__(self, prompt_chars: int, *, streamed: bool, status: int) -> None:
        self.prompt_chars = prompt_chars
        self.streamed = streamed
        self.ok = 200 <= status < 300
        self.content_chunks = 0
        self._reported: Usage | None = None
        # choice index -> its usage so far, from chunks that carry both choices and usage
        # (`stream_options.continuous_usage_stats`, vLLM's: each such chunk counts its own
        # choice, not the answer; only the final chunk, without choices, has the total)
        self._per_choice: dict[Any, Usage] = {}
        self._pending = bytearray()  # streamed: the unfinished last line; else: the body
        self._body_too_large = False

    def feed(self, chunk: bytes) -> None:
        """One relayed chunk of the answer's body."""
        if not self.ok:
            return
        if not self.streamed:
            if len(self._pending) + len(chunk) > MAX_JSON_BYTES:
                self._body_too_large = True
                self._pending.clear()
            elif not self._body_too_large:
                self._pending.extend(chunk)
            return
        last_newline = chunk.rfind(b"\n")
        if last_newline < 0:  # still inside one line
            if len(self._pending) + len(chunk) > MAX_LINE_BYTES:
                self._pending.clear()  # the rest of that line cannot parse: it is skipped
            else:
                self._pending.extend(chunk)
            return
        lines = bytes(self._pending) + chunk[:last_newline]
        self._pending = bytearray(chunk[last_newline + 1:])
        for line in lines.split(b"\n"):
            self._read_line(line.strip())

    def _read_line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # `event:` lines, comments, blank separators
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        reported = usage_of(event)
        if reported is not None:
            choices = event.get("choices") if isinstance(event, dict) else None
            if isinstance(choices, list) and choices:
                # A per-choice count (see __init__): with n > 1 the last one is one choice's,
                # so a stream cut short before its total is charged every choice's tokens.
                for choice in choices:
                    if isinstance(choice, dict):
                        self._per_choice[choice.get("index")] = reported
            else:
                self._reported = reported
        elif _is_content(event):
            self.content_chunks += 1

    def result(self) -> Usage:
        """The answer's usage: the one it reported, else the estimate (nothing for an error)."""
        if not self.ok:
            return NO_USAGE
        if not self.streamed and self._pending:
            try:
                self._reported = usage_of(json.loads(bytes(self._pending)))
            except (UnicodeDecodeError, json.JSONDecodeError):
                pass  # cut short: estimated below
        if self._reported is None and self._per_choice:
            # Cut short before the total: every choice's tokens so far. The prompt is counted
            # once (the choices of a chat answer share it; for a completions batch of several
            # prompts this is the longest one's count, a lower bound).
            return Usage(max(u.prompt_tokens for u in self._per_choice.values()),
                         sum(u.completion_tokens for u in self._per_choice.values()))
        return self._reported or estimate(self.prompt_chars, self.content_chunks)
