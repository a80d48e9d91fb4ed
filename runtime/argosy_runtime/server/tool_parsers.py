"""tool_choice "auto": tool calls the model chose to write, parsed out of its text.

With `--tool-call-parser`, a chat request with `tools` and tool_choice "auto" (or unset,
OpenAI's default when tools are given) generates freely, and the calls the model wrote in its
family's format come back as OpenAI `tool_calls` (finish_reason "tool_calls"); any other text
stays content. Text that is not a well-formed call, or is cut off (max_tokens), is left as
content, so nothing the model wrote is lost: that includes JSON nested too deep to read, `NaN`
and infinities (not JSON), and a lone surrogate escape (`"\\ud800"`: no UTF-8 response can
carry it). With `parallel_tool_calls` false only the first call is sent, the rest dropped, as
vLLM does.

- `hermes` (Qwen2.5, Hermes and many other tool-trained models): calls are blocks

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  anywhere in the reply. Streaming sends content as it comes, holding back only what could be
  the start of a `<tool_call>` tag, and each call whole once its block closes.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): a reply that is a call is
  JSON from its first character, `{"name": "get_weather", "parameters": {"city": "Paris"}}`
  (several separated by `;`), possibly after `<|python_tag|>`; JSON without "parameters" or
  "arguments" (`{"name": "John", "age": 30}`) is an answer, not a call. Streaming sends a
  reply that does not start with `{` as content at once, and one that does when complete.
- `mistral` (Mistral 7B Instruct v0.3, Mistral Small / Nemo, Magistral, Devstral): calls follow
  a `[TOOL_CALLS]` marker, after any content: a JSON list
  `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]` (v0.3 tokenizers), or
  one marker per call, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` (newer tokenizers;
  `name{...}` without `[ARGS]` too). Call ids are 9 letters and digits, as Mistral's own
  templates require. Streaming sends the content before the marker as it comes and the calls
  when the reply is complete.
- `pythonic` (Llama 3.2, Llama 4 and other models trained on Python-style calls): a reply that
  is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris", unit="celsius"), get_time()]`, read with `ast` (never run).
  Streaming is as llama3_json's, with `[` for `{`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from argosy_runtime.server.tool_calls import new_call_id, new_mistral_call_id


class ToolCallParserStream:
    """One choice's text in, content and tool-call deltas out: `feed` each piece of text,
    `finish` at the end (or `step`, which does both as a stream needs them)."""

    # True where the format's marker may be a control token (Mistral's [TOOL_CALLS], the
    # <tool_call> tags of Hermes 2 Pro) that decoding with skip_special_tokens would drop:
    # the server then keeps special tokens for requests with tools (as vLLM's parsers do).
    keep_special_tokens = False

    def __init__(self) -> None:
        self.calls = 0  # tool calls the model wrote so far
        # `parallel_tool_calls` false: only the first call is sent, the rest dropped (as vLLM
        # does; a client that asked for one call at a time runs exactly one)
        self.parallel_calls = True

    def feed(self, text: str) -> dict[str, Any]:
        """A delta (`content` and/or `tool_calls`) for newly generated text; {} if none."""
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """What is still held back at the end of the choice, as a delta."""
        raise NotImplementedError

    def step(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for newly generated text and the choice's finish_reason; at the end
        (`finish_reason` set) with what `finish` releases folded in."""
        delta = self.feed(text)
        if finish_reason is None:
            return delta, None
        delta = _merged(delta, self.finish())
        return delta, "tool_calls" if finish_reason == "stop" and self.calls else finish_reason

    def _delta(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if not self.parallel_calls:
            calls = [call for call in calls if call["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta


class HermesToolCallStream(ToolCallParserStream):
    START, END = "<tool_call>", "</tool_call>"
    keep_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text received and not yet sent
        self._in_call = False

    def feed(self, text: str) -> dict[str, Any]:
        self._pending += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._pending.find(self.END)
                if end < 0:
                    break
                block = self._pending[:end]
                self._pending = self._pending[end + len(self.END):]
                self._in_call = False
                call = _call_of(block)
                if call is None:  # not a call after all: give the model's text back
                    content += self.START + block + self.END
                else:
                    calls.append({"index": self.calls, **call})
                    self.calls += 1
                continue
            start = self._pending.find(self.START)
            if start < 0:
                ready = len(self._pending) - _partial_tag_length(self._pending, self.START)
                if not self._between_calls(self._pending[:ready]):
                    content += self._pending[:ready]
                    self._pending = self._pending[ready:]
                break
            if not self._between_calls(self._pending[:start]):
                content += self._pending[:start]
            self._pending = self._pending[start + len(self.START):]
            self._in_call = True
        return self._delta(content, calls)

    def finish(self) -> dict[str, Any]:
        """An unclosed block goes back as content."""
        rest = (self.START if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return self._delta("" if self._between_calls(rest) else rest, [])

    def _between_calls(self, text: str) -> bool:
        """Whitespace after a call: the newlines between and after calls are no answer. It is
        held until it turns out to be more than that, so any split gives the same content."""
        return self.calls > 0 and not text.strip()


class Llama3JsonToolCallStream(ToolCallParserStream):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._json: bool | None = None  # undecided until the first visible character

    def feed(self, text: str) -> dict[str, Any]:
        if self._json is False:
            return self._delta(text, [])
        self._pending += text
        head = self._pending.lstrip()
        head = head[len(self.TAG):].lstrip() if head.startswith(self.TAG) else head
        if not head or self.TAG.startswith(head):
            return {}  # nothing visible yet, or what may become the tag
        self._json = head.startswith("{")
        if self._json:
            return {}  # a call is sent whole, once the reply is complete
        out, self._pending = self._pending, ""
        return self._delta(out, [])

    def finish(self) -> dict[str, Any]:
        """A reply that started as JSON: its calls, or the text if it is not calls."""
        text, self._pending = self._pending, ""
        # blanks may follow the tag too, as `feed` allows when it decides the reply is JSON
        body = text.strip().removeprefix(self.TAG).lstrip()
        calls = _json_calls(body) if self._json else None
        if calls is None:
            return self._delta(text, [])
        self.calls = len(calls)
        return self._delta("", [{"index": i, **call} for i, call in enumerate(calls)])


class MistralToolCallStream(ToolCallParserStream):
    TAG = "[TOOL_CALLS]"
    keep_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text received and not yet sent
        self._in_calls = False  # past the marker: the rest of the reply is held for finish

    def feed(self, text: str) -> dict[str, Any]:
        self._pending += text
        if self._in_calls:
            return {}
        start = self._pending.find(self.TAG)
        if start >= 0:
            # The marker stays with the calls: if they are malformed, all of it is content.
            content, self._pending = self._pending[:start], self._pending[start:]
            self._in_calls = True
            return self._delta(content, [])
        ready = len(self._pending) - _partial_tag_length(self._pending, self.TAG)
        content, self._pending = self._pending[:ready], self._pending[ready:]
        return self._delta(content, [])

    def finish(self) -> dict[str, Any]:
        text, self._pending = self._pending, ""
        calls = _mistral_calls(text) if self._in_calls else None
        if calls is None:
            return self._delta(text, [])
        self.calls = len(calls)
        return self._delta("", [{"index": i, **call} for i, call in enumerate(calls)])


class PythonicToolCallStream(ToolCallParserStream):
    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._list: bool | None = None  # undecided until the first visible character

    def feed(self, text: str) -> dict[str, Any]:
        if self._list is False:
            return self._delta(text, [])
        self._pending += text
        head = self._pending.lstrip()
        if not head:
            return {}
        self._list = head.startswith("[")
        if self._list:
            return {}  # calls are sent once the list is complete (it may turn out not to be)
        out, self._pending = self._pending, ""
        return self._delta(out, [])

    def finish(self) -> dict[str, Any]:
        text, self._pending = self._pending, ""
        calls = _pythonic_calls(text) if self._list else None
        if calls is None:
            return self._delta(text, [])
        self.calls = len(calls)
        return self._delta("", [{"index": i, **call} for i, call in enumerate(calls)])


# One per name in server/config.py TOOL_CALL_PARSERS (the flag's choices).
STREAMS: dict[str, type[ToolCallParserStream]] = {
    "hermes": HermesToolCallStream, "llama3_json": Llama3JsonToolCallStream,
    "mistral": MistralToolCallStream, "pythonic": PythonicToolCallStream}


def make_stream(parser: str, parallel_calls: bool = True) -> ToolCallParserStream:
    """A fresh per-choice stream for `--tool-call-parser parser`."""
    if parser not in STREAMS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(STREAMS)}, "
                         f"got {parser!r}")
    stream = STREAMS[parser]()
    stream.parallel_calls = parallel_calls
    return stream


def parse_message(parser: str, text: str, finish_reason: str | None,
                  parallel_calls: bool = True) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish_reason of a finished (non-streamed) choice."""
    stream = make_stream(parser, parallel_calls)
    delta = _merged(stream.feed(text), stream.finish())
    calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls", [])]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": delta.get("content", "").strip() or None,
               "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _merged(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two deltas of one choice as one (content appended, tool calls appended)."""
    out = dict(first)
    if then.get("content"):
        out["content"] = out.get("content", "") + then["content"]
    if then.get("tool_calls"):
        out["tool_calls"] = out.get("tool_calls", []) + then["tool_calls"]
    return out


# JSON that is not read as a call: malformed, or nested deeper than Python's recursion limit
# (a model stuck repeating "[" writes that), which json raises RecursionError for.
_UNREADABLE = (json.JSONDecodeError, RecursionError)


def _call_of(block: str) -> dict[str, Any] | None:
    """One OpenAI tool call from a block's JSON, or None if it is not one."""
    try:
        return _call_of_value(json.loads(block))
    except _UNREADABLE:
        return None


def _call_of_value(value: Any, call_id: str | None = None) -> dict[str, Any] | None:
    """`{"name": ..., "arguments" or "parameters": {...}}` as an OpenAI tool call, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # the object as JSON text, as some models write it
        try:
            arguments = json.loads(arguments)
        except _UNREADABLE:
            return None
    # A call's arguments are an object (clients pass them as keyword arguments): `"Paris"`,
    # `null` or `[1]` there is no call, and taking a string as is sent text no JSON reader took.
    if not isinstance(arguments, dict):
        return None
    return _call(value["name"], _arguments_json(arguments), call_id)


def _arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON text; None for NaN and infinities (`NaN`, `1e999`), which
    Python's json reads but JSON has not, so no client could read the arguments back."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def _call(name: str, arguments: str | None, call_id: str | None = None
          ) -> dict[str, Any] | None:
    """An OpenAI tool call; None without arguments, or if a lone surrogate is in it (the
    model wrote an unpaired `\\udXXX` escape), which UTF-8, and so the response, cannot
    carry: the model's text then stays content, as any call not well-formed."""
    if arguments is None or not _utf8(name + arguments):
        return None
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# A function name as Mistral's newer format writes it before [ARGS] (vLLM's pattern).
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _mistral_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls in `text`, which starts with [TOOL_CALLS]; None unless all of it is calls."""
    segments = text.split(MistralToolCallStream.TAG)[1:]
    if segments[0].lstrip().startswith("["):  # v0.3: one marker, then a JSON list of calls
        if len(segments) != 1:
            return None
        try:
            value = json.loads(segments[0])
        except _UNREADABLE:
            return None
        if not isinstance(value, list) or not value:
            return None
        listed = [_call_of_value(item, new_mistral_call_id()) for item in value]
        return [call for call in listed if call is not None] if None not in listed else None
    calls = []
    for segment in segments:  # newer: a marker per call, name[ARGS]{arguments}
        name, args_tag, arguments = segment.partition("[ARGS]")
        if not args_tag:  # mistral_common decodes without the [ARGS] token: name{arguments}
            brace = segment.find("{")
            if brace < 0:
                return None
            name, arguments = segment[:brace], segment[brace:]
        name = name.strip()
        try:
            value = json.loads(arguments)
        except _UNREADABLE:
            return None
        if not _MISTRAL_NAME.fullmatch(name) or not isinstance(value, dict):
            return None
        call = _call(name, _arguments_json(value), new_mistral_call_id())
        if call is None:
            return None
        calls.append(call)
    return calls


def _pythonic_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls in a reply that is `[f(a=1), g(b="x")]`; None unless it is exactly a
    non-empty list of calls by name with literal keyword arguments. Nothing is evaluated but
    literals (`ast.literal_eval`), so a reply that is any other Python stays content."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        # Positional arguments have no parameter name to go under: not a call we can return.
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        names = [kw.arg for kw in node.keywords]
        if None in names or len(set(names)) != len(names):  # **kwargs, or a name repeated
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            # allow_nan=False: 1e999 is inf, which is not JSON; sets, bytes, complex raise too
            call = _call(node.func.id,
                         json.dumps(arguments, ensure_ascii=False, allow_nan=False))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def _json_calls(body: str) -> list[dict[str, Any]] | None:
    """The calls in `body`: JSON objects separated by `;` or whitespace; None unless all are."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except _UNREADABLE:
            return None
        # A reply that is JSON is a call only with its arguments (as in vLLM): a model asked
        # for data writes `{"name": "John", "age": 30}`, no call to a function "John".
        if not isinstance(value, dict) or not ("arguments" in value or "parameters" in value):
            return None
        call = _call_of_value(value)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls or None


def _partial_tag_length(text: str, tag: str) -> int:
    """The longest end of `text` that is a beginning of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
