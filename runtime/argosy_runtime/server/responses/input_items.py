"""The `input` of POST /v1/responses, checked item by item, as chat messages and as
`GET /v1/responses/{id}/input_items` lists it.

Items, in OpenAI's shapes (each 400 names the exact item and part, `input[1].content[0].type`):

- a message `{"role": "user" | "system" | "developer" | "assistant", "content": str | [parts]}`
  (with or without `"type": "message"`), parts `input_text` / `output_text` / `refusal`
  joined into one text -> a chat message;
- `{"type": "function_call", "call_id", "name", "arguments"}` (an earlier output item passed
  back) -> a tool call of an assistant message: consecutive calls, and calls right after an
  assistant message, share one message, as chat writes them;
- `{"type": "function_call_output", "call_id", "output"}` -> a `role: "tool"` message with
  `tool_call_id`; its `call_id` must be that of a function call earlier in the conversation
  (this input or the stored one behind `previous_response_id`), as OpenAI requires;
- `{"type": "reasoning", "summary": [...], "content": [{"type": "reasoning_text", "text"}]}`
  (an earlier output item passed back, `input += response.output`) -> listed, but no chat
  message: earlier thinking is dropped from the prompt, as chat drops an assistant message's
  `reasoning_content` (vLLM hands it to the template, whose Qwen3/DeepSeek-R1 versions drop
  earlier turns' thinking too; the stored conversation behind `previous_response_id` skips
  reasoning items, as vLLM's). `encrypted_content` is a 400: this server never makes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.responses.response_object import message_item, new_item_id
from argosy_runtime.server.responses.tools import chat_tool_call

ROLES = ("user", "system", "developer", "assistant")
# content part type -> the key holding its text
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs", "refusal"})
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "id", "call_id", "name", "arguments", "status"})
_OUTPUT_KEYS = frozenset({"type", "id", "call_id", "output", "status"})
_REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
_REASONING_PARTS = {"summary": "summary_text", "content": "reasoning_text"}
_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", dict: "an object",
               str: "a string", list: "a list"}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


@dataclass(frozen=True)
class ParsedInput:
    messages: list[dict[str, Any]]  # chat messages (`role`, `content`, `tool_calls`, ...)
    items: list[dict[str, Any]]  # the items as input_items lists them


def parse_input(value: Any, history: Iterable[dict[str, Any]] = ()) -> ParsedInput:
    """`input` (a string or a list of items) after the chat messages of `history`."""
    if isinstance(value, str):
        return ParsedInput([{"role": "user", "content": value}],
                           [_listed_message("user", value)])
    if not isinstance(value, list):
        raise bad_request(f"input: expected a string or a list of input items, got "
                          f"{_JSON_TYPES.get(type(value), 'null')}", "input")
    if not value:
        raise bad_request("input: must not be an empty list", "input")
    known_calls = {call.get("id") for m in history for call in m.get("tool_calls") or []}
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: expected an input item object (a message, "
                              "function_call or function_call_output)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            messages.append(message)
            items.append(_listed_message(message["role"], message["content"], item.get("id")))
        elif kind == "function_call":
            listed = _function_call(item, where)
            known_calls.add(listed["call_id"])
            call = chat_tool_call(listed)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn, several calls
                messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            items.append(listed)
        elif kind == "function_call_output":
            listed, text = _function_call_output(item, where)
            if listed["call_id"] not in known_calls:
                raise bad_request(f"{where}.call_id: no function call with call_id "
                                  f"{listed['call_id']!r} comes before this output (in "
                                  "input or the previous response)", "input")
            messages.append({"role": "tool", "tool_call_id": listed["call_id"],
                             "content": text})
            items.append(listed)
        elif kind == "reasoning":
            items.append(_reasoning(item, where))  # not shown to the model (see above)
        else:
            raise bad_request(f"{where}.type: input items of type {kind!r} are not supported "
                              "(only message, function_call, function_call_output, "
                              "reasoning)", "input")
    return ParsedInput(messages, items)


def _listed_message(role: str, text: str, item_id: Any = None) -> dict[str, Any]:
    """A message as input_items lists it: under the id it was sent back with (an earlier
    response's `msg_...`), as function calls keep theirs; a new one if it has none."""
    if not (isinstance(item_id, str) and item_id):
        item_id = new_item_id("msg")
    if role == "assistant":
        return message_item(item_id, text, "completed")
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extra(item, _MESSAGE_KEYS, where)
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}",
                          "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of content parts",
                          "input")
    return {"role": role,
            "content": "\n".join(_part_text(p, f"{where}.content[{j}]")
                               for j, p in enumerate(content))}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extra(item, _CALL_KEYS, where)
    for key in ("call_id", "name", "arguments"):
        _string(item, key, where, empty_ok=key == "arguments")
    item_id = item.get("id")
    return {"id": item_id if isinstance(item_id, str) and item_id else new_item_id("fc"),
            "type": "function_call", "call_id": item["call_id"], "name": item["name"],
            "arguments": item["arguments"], "status": "completed"}


def _function_call_output(item: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    _no_extra(item, _OUTPUT_KEYS, where)
    _string(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, str):
        text = output
    elif isinstance(output, list):
        text = "\n".join(_part_text(p, f"{where}.output[{j}]") for j, p in enumerate(output))
    else:
        raise bad_request(f"{where}.output: expected a string or a list of content parts",
                          "input")
    item_id = item.get("id")
    listed = {"id": item_id if isinstance(item_id, str) and item_id else new_item_id("fco"),
              "type": "function_call_output", "call_id": item["call_id"], "output": output,
              "status": "completed"}
    return listed, text


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A reasoning item as input_items lists it (its parts checked, as OpenAI's)."""
    _no_extra(item, _REASONING_KEYS, where)
    if item.get("encrypted_content") is not None:
        raise bad_request(f"{where}.encrypted_content: encrypted reasoning is not supported "
                          "(this server never returns it)", "input")
    item_id = item.get("id")
    listed: dict[str, Any] = {"id": item_id if isinstance(item_id, str) and item_id
                              else new_item_id("rs"), "type": "reasoning"}
    for key, part_type in _REASONING_PARTS.items():
        parts = item.get(key)
        if parts is None and key == "content":
            continue
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{key}: expected a list of {part_type} parts", "input")
        for j, part in enumerate(parts):
            if not (isinstance(part, dict) and part.get("type") == part_type
                    and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                raise bad_request(f"{where}.{key}[{j}]: expected "
                                  f'{{"type": "{part_type}", "text": <string>}}', "input")
        listed[key] = parts
    status = item.get("status")
    return {**listed, "status": status if status in ("in_progress", "incomplete")
            else "completed"}


def _string(item: dict[str, Any], key: str, where: str, empty_ok: bool = False) -> None:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty_ok):
        got = "missing" if key not in item else f"got {_JSON_TYPES.get(type(value), 'null')}"
        raise bad_request(f"{where}.{key}: expected a{'' if empty_ok else ' non-empty'} "
                          f"string ({got})", "input")


def _no_extra(item: dict[str, Any], keys: frozenset[str], where: str) -> None:
    extra = sorted(set(item) - keys)
    if extra:
        raise bad_request(f"{where}: unknown field {extra[0]!r}", "input")


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where}: expected a content part object", "input")
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        what = ("is not supported: this model reads text only" if kind in _MEDIA_PARTS
                else "is not a known content part type")
        raise bad_request(f"{where}.type: {kind!r} {what} (use input_text or output_text)",
                          "input")
    _no_extra(part, _PART_KEYS, where)
    text = part.get(key)
    if not isinstance(text, str):
        raise bad_request(f"{where}.{key}: expected a string", "input")
    return text
