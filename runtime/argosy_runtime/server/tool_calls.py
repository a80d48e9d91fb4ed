"""Tool calling for `tool_choice` "required" or a named function, by structured outputs.

The model's output is constrained to JSON that describes the call, then returned as OpenAI
`tool_calls`:

- a named function (`{"type": "function", "function": {"name": "f"}}`): the output is f's
  arguments, matching its `parameters` schema; one call, `finish_reason` "stop" (as OpenAI),
  or "length" with the arguments cut short (as streamed, and as vLLM);
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`, each item
  matching one of the tools (at most one item when `parallel_tool_calls` is false);
  `finish_reason` "tool_calls".

This works with any model, since the grammar (not the model's training) fixes the format.
"auto", where the model decides whether to call, needs the model family's own tool-call
syntax and a parser for it: `--tool-call-parser` (server/tool_parsers.py); without one it is a
400, as in vLLM.
"""

from __future__ import annotations

import copy
import json
import random
import string
import uuid
from collections.abc import Callable
from typing import Any

from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import ChatCompletionRequest, ChatTool
from argosy_runtime.structured_output import StructuredOutputsParams

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def forced_tool(req: ChatCompletionRequest) -> ChatTool | None:
    """The tool a named tool_choice forces, or None when tool_choice is not a name."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    for tool in req.tools or []:
        if tool.function.name == choice.function.name:
            return tool
    raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools",
                      "tool_choice")


def calls_tools(req: ChatCompletionRequest) -> bool:
    """True when the reply must be tool calls ("required" or a named function)."""
    return req.tool_choice not in (None, "none", "auto")


def may_call_tools(req: ChatCompletionRequest, parser: str | None) -> bool:
    """True when the model may choose to call tools (tool_choice "auto", or unset with tools:
    OpenAI's default) and a parser reads its calls out of the text."""
    return parser is not None and bool(req.tools) and req.tool_choice in (None, "auto")


def check_tool_choice(req: ChatCompletionRequest, parser: str | None = None) -> None:
    choice = req.tool_choice
    if choice == "auto" and parser is None:
        raise bad_request("tool_choice 'auto' needs a server started with --tool-call-parser "
                          "(the model's own tool-call format); use 'required' or name a "
                          "function", "tool_choice")
    if choice not in (None, "none") and not req.tools:
        raise bad_request("tool_choice requires tools", "tool_choice")
    forced_tool(req)  # a name that is not in tools is a 400


def tool_call_constraint(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """What the output must match when the reply is tool calls."""
    if not calls_tools(req):
        return None
    tool = forced_tool(req)
    if tool is not None:
        return StructuredOutputsParams(json=_arguments_schema(tool))
    items = []
    for i, tool in enumerate(req.tools):
        params = _arguments_schema(tool)
        if not isinstance(params.get("$defs", {}), dict):
            raise bad_request(f"tools: $defs of {tool.function.name!r} must be an object", "tools")
        # Each tool's schema is a resource of its own ($id), so that its local references
        # ("#/$defs/X", draft-07's "#/definitions/X", "#" for itself) resolve against it, not
        # against this array: two tools may then define the same $defs name differently.
        # A draft-04 (or -03) schema names itself with `id` and ignores `$id`: it needs both,
        # `$id` for the array around it to find it, `id` for its references to resolve in it.
        draft4 = str(params.get("$schema", "")).rstrip("#").endswith(("draft-04/schema",
                                                                       "draft-03/schema"))
        own_id = params.get("id") if draft4 and isinstance(params.get("id"), str) else None
        params.setdefault("$id", own_id or f"urn:argosy:tool:{i}")
        if draft4:
            params.setdefault("id", params["$id"])
        items.append({"type": "object",
                      "properties": {"name": {"enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _arguments_schema(tool: ChatTool) -> dict[str, Any]:
    """A copy of the tool's `parameters`, as the schema its arguments are generated under:
    always an object. `properties` and `required` alone do not make a value an object in JSON
    Schema (`"Paris"`, `null` and `5` match `{"properties": {...}}`), and a model held to such
    a schema wrote exactly those as a call's arguments, which clients call the function with
    as keyword arguments. Another `type` is a 400, as OpenAI answers it."""
    params = tool.function.parameters
    if not params:
        return copy.deepcopy(_NO_ARGUMENTS)
    kind = params.get("type", "object")
    if kind != "object":
        raise bad_request(f"tools: the parameters of {tool.function.name!r} must be a JSON "
                          f"schema of type 'object', not {kind!r}", "tools")
    return {**copy.deepcopy(params), "type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """Mistral's templates (mistral_common) reject a tool call id that is not exactly 9
    letters and digits when the conversation comes back, so these calls get such ids (as in
    vLLM)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def call_id_maker(tool_call_parser: str | None) -> Callable[[], str]:
    """How the server's calls are named: forced and "required" calls too, so that a Mistral
    model's conversation, sent back with them, renders (`new_mistral_call_id`)."""
    return new_mistral_call_id if tool_call_parser == "mistral" else new_call_id


def tool_calls_of(text: str, new_id: Callable[[], str] = new_call_id
                  ) -> list[dict[str, Any]] | None:
    """The OpenAI tool_calls of a finished "required" output (a JSON array of calls); None
    when it is not complete JSON (cut by a stop string), in which case the caller returns the
    text as content."""
    try:
        value = json.loads(text)
        calls = [(item["name"], _sendable_arguments(item["parameters"])) for item in value]
    # RecursionError: nested deeper than Python reads JSON; KeyError, TypeError: valid JSON
    # of another shape (a stop string cut it)
    except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
        return None
    return [{"id": new_id(), "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


def _sendable_arguments(value: Any) -> str:
    """A call's arguments as JSON text, non-ASCII characters as they are; all escaped if a
    lone surrogate is in them (the output held an unpaired `\\udXXX` escape, which JSON
    allows), since UTF-8, and so the response, cannot carry one. Both read back the same."""
    arguments = json.dumps(value, ensure_ascii=False)
    try:
        arguments.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return arguments


def reply_message(req: ChatCompletionRequest, text: str, finish_reason: str | None,
                  new_id: Callable[[], str] = new_call_id
                  ) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish_reason of a finished choice that must call tools
    (its calls named by `new_id`: `call_id_maker`)."""
    tool = forced_tool(req)
    if tool is not None and text:
        # A named function's output is its arguments, cut short (max_tokens, a stop string)
        # or not: one call, as streamed (ToolCallStream) and as vLLM answers it.
        call = {"id": new_id(), "type": "function",
                "function": {"name": tool.function.name, "arguments": text}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason
    calls = tool_calls_of(text, new_id) if finish_reason == "stop" else None
    if calls is None:  # cut short (max_tokens, a stop string): give the text back as it is
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


class ToolCallStream:
    """Turns each choice's streamed text into `tool_calls` deltas.

    A named function's output is its arguments, so it streams as argument fragments (the first
    carries the call's id and name). A "required" output is an array of calls whose names are
    known only as it completes, so its calls are sent whole when the choice finishes.
    """

    def __init__(self, req: ChatCompletionRequest, n: int,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.req = req
        self.tool = forced_tool(req)
        self.started = [False] * n
        self.new_id = new_id

    def delta(self, index: int, text: str, finish_reason: str | None,
              full_text: str) -> tuple[dict[str, Any], str | None]:
        if self.tool is not None:
            if not text:
                return {}, finish_reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.started[index]:
                self.started[index] = True
                call = {"index": 0, "id": self.new_id(), "type": "function",
                        "function": {"name": self.tool.function.name, "arguments": text}}
            return {"tool_calls": [call]}, finish_reason
        if finish_reason is None:
            return {}, None
        message, finish = reply_message(self.req, full_text, finish_reason, self.new_id)
        if "tool_calls" in message:
            return {"tool_calls": [{"index": i, **call}
                                   for i, call in enumerate(message["tool_calls"])]}, finish
        return ({"content": full_text} if full_text else {}), finish
