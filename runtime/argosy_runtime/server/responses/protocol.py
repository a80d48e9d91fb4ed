"""The request schema of POST /v1/responses (OpenAI's Responses API) and its input items.

Like every request here, unknown fields are a 400. OpenAI fields are in three groups:
honoured (`model`, `input`, `instructions`, `max_output_tokens`, `temperature`, `top_p`,
`stream`, `store`, `previous_response_id`, `text.format`), accepted and echoed without effect
(`user`, `metadata`, `parallel_tool_calls`, `service_tier`, `safety_identifier`,
`prompt_cache_key`, `prompt_cache_retention`, `max_tool_calls`, `reasoning.effort`,
`stream_options`), and accepted only at their "off" value, anything else a 400 naming the
field (`tools`, `tool_choice`, `include`, `background`, `truncation`, `top_logprobs`,
`reasoning.summary`). vLLM's sampling extras are accepted as on chat completions.

Input items are plain dicts, checked by `input_messages` so that each 400 names the exact
item and part (`input[1].content[0].type`) in OpenAI's words.
"""

from __future__ import annotations

from typing import Any, Literal

from argosy_runtime.server.errors import bad_request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

_FORBID = ConfigDict(extra="forbid")

ROLES = ("user", "system", "developer", "assistant")
# content part type -> the key holding its text
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs", "refusal"})
_ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", dict: "an object"}
# Built-in OpenAI tools: they run on OpenAI's side, never here.
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                 "code_interpreter", "image_generation", "mcp", "local_shell", "shell")


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (flat, unlike
    chat's `response_format.json_schema`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = _FORBID
    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = _FORBID
    effort: str | None = None  # accepted and ignored, like chat's reasoning_effort
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(BaseModel):
    model_config = _FORBID
    include_obfuscation: StrictBool | None = None  # no obfuscation field is ever added


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = _FORBID

    model: str | None = None
    input: Any  # a string or a list of input items: checked by `input_messages`
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    # bounds as on chat completions (protocol._SamplingFields)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = True
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    parallel_tool_calls: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    include: list[str] | None = None
    background: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: Reasoning | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM extras (DESIGN.md), as on chat completions
    ignore_eos: StrictBool = False
    min_tokens: int = Field(default=0, ge=0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    stop_token_ids: list[int] | None = None
    priority: StrictInt = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)


def reject_unsupported(req: ResponsesRequest) -> None:
    """Fields OpenAI defines that this server cannot honour: a 400 naming each."""
    if req.tools:
        kinds = sorted({str(t.get("type")) for t in req.tools})
        builtin = [k for k in kinds if k in BUILTIN_TOOLS]
        what = (f"built-in tools ({', '.join(builtin)}) are not available here"
                if builtin else "tools are not supported on /v1/responses by this server "
                                "(use /v1/chat/completions for function calling)")
        raise bad_request(f"tools: {what}", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice: only 'none' or 'auto' (no tools are supported on "
                          "/v1/responses)", "tool_choice")
    if req.include:
        raise bad_request(f"include: {req.include[0]!r} is not supported", "include")
    if req.background:
        raise bad_request("background: background responses are not supported; stream, or "
                          "wait for the answer", "background")
    if req.truncation == "auto":
        raise bad_request("truncation: 'auto' is not supported (the input is never "
                          "truncated; a too long input is a 400)", "truncation")
    if req.top_logprobs:
        raise bad_request("top_logprobs: logprobs are not supported on /v1/responses",
                          "top_logprobs")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        raise bad_request("reasoning.summary: reasoning summaries are not supported",
                          "reasoning")


def input_messages(value: Any) -> list[dict[str, str]]:
    """The request's input as chat messages ({"role", "content": str}), checked item by item."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"input: expected a string or a list of input items, got "
                          f"{_JSON_TYPES.get(type(value), 'null')}", "input")
    if not value:
        raise bad_request("input: must not be an empty list", "input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise bad_request(f"{where}: expected an input item object (a message)", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise bad_request(f"{where}.type: input items of type {kind!r} are not supported "
                          "(only messages: this server runs no tools)", "input")
    extra = sorted(set(item) - _ITEM_KEYS)
    if extra:
        raise bad_request(f"{where}: unknown field {extra[0]!r}", "input")
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
            "content": "".join(_part_text(p, f"{where}.content[{j}]")
                               for j, p in enumerate(content))}


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where}: expected a content part object", "input")
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        what = ("is not supported: this model reads text only"
                if kind in ("input_image", "input_file", "input_audio")
                else "is not a known content part type")
        raise bad_request(f"{where}.type: {kind!r} {what} (use input_text or output_text)",
                          "input")
    extra = sorted(set(part) - _PART_KEYS)
    if extra:
        raise bad_request(f"{where}: unknown field {extra[0]!r}", "input")
    text = part.get(key)
    if not isinstance(text, str):
        raise bad_request(f"{where}.{key}: expected a string", "input")
    return text
