"""Function tools on /v1/responses, mapped onto chat's tools (server/tool_calls.py,
server/tool_parsers.py), and chat's tool calls back as Responses `function_call` items.

Responses' function tools are flat (`{"type": "function", "name", "description",
"parameters", "strict"}`) where chat nests them under `function`; so is a named
`tool_choice` (`{"type": "function", "name"}`). Built-in tools (web_search, file_search, ...)
run on OpenAI's side and are a 400 here, each named.
"""

from __future__ import annotations

from typing import Any

from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import ChatTool, NamedToolChoice
from pydantic import ValidationError

# Built-in OpenAI tools: they run on OpenAI's side, never here.
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                 "computer_use", "code_interpreter", "image_generation", "mcp", "local_shell",
                 "shell", "custom", "apply_patch")
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_CHOICES = ("none", "auto", "required")


def function_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's `tools`, checked, as the Response echoes them (Responses' flat shape)."""
    out = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where}: expected a tool object", "tools")
        kind = tool.get("type")
        if kind != "function":
            what = ("is a built-in OpenAI tool, not available here"
                    if kind in BUILTIN_TOOLS else "is not a known tool type")
            raise bad_request(f"{where}.type: {kind!r} {what} (only 'function' tools are "
                              "supported)", "tools")
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise bad_request(f"{where}: unknown field {extra[0]!r}", "tools")
        if "name" not in tool:
            raise bad_request(f"{where}.name: required for a function tool", "tools")
        try:
            ChatTool(type="function", function={k: v for k, v in tool.items() if k != "type"})
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(map(str, error["loc"][1:])) or "function"
            raise bad_request(f"{where}.{field}: {error['msg']}", "tools") from None
        out.append({"type": "function", "name": tool["name"],
                    "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    names = [t["name"] for t in out]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"tools: the function name {name!r} is used twice", "tools")
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[ChatTool] | None:
    """Checked function tools (`function_tools`) as chat's `tools`."""
    if not tools:
        return None
    return [ChatTool(type="function", function={k: v for k, v in t.items()
                                                if k != "type" and v is not None})
            for t in tools]


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]]
                     ) -> str | NamedToolChoice | None:
    """The request's `tool_choice` as chat's. Without tools, "none" and "auto" mean nothing
    and are dropped (chat would ask for a tool-call parser for "auto")."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise bad_request(f"tool_choice: expected one of {', '.join(_CHOICES)} or "
                              f"{{'type': 'function', 'name': ...}}, got {choice!r}",
                              "tool_choice")
        return None if choice in ("none", "auto") and not tools else choice
    if not isinstance(choice, dict):
        raise bad_request("tool_choice: expected a string or an object", "tool_choice")
    kind = choice.get("type")
    if kind != "function":
        raise bad_request(f"tool_choice.type: {kind!r} is not supported (only 'function' "
                          "tools exist here)", "tool_choice")
    extra = sorted(set(choice) - {"type", "name"})
    if extra:
        raise bad_request(f"tool_choice: unknown field {extra[0]!r}", "tool_choice")
    name = choice.get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice.name: required (a string)", "tool_choice")
    if name not in {t["name"] for t in tools}:
        raise bad_request(f"tool_choice.name: {name!r} is not one of the function tools",
                          "tool_choice")
    return NamedToolChoice(type="function", function={"name": name})


def chat_tool_call(item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` item as a chat tool call (what an assistant message carries)."""
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
