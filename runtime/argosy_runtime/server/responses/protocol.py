"""The request schema of POST /v1/responses (OpenAI's Responses API).

Like every request here, unknown fields are a 400. OpenAI fields are in three groups:
honoured (`model`, `input`, `instructions`, `max_output_tokens`, `temperature`, `top_p`,
`stream`, `store`, `background` (with `store`), `previous_response_id`, `text.format`,
function `tools`, `tool_choice`, `parallel_tool_calls`), accepted and echoed without effect
(`user`, `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
`prompt_cache_retention`, `max_tool_calls`, `reasoning.effort`, `text.verbosity`,
`stream_options`), and accepted only at their "off" value, anything else a 400 naming the
field (`include`, `truncation`, `top_logprobs`, `reasoning.summary`). vLLM's sampling extras
are accepted as on chat completions.

`input`, `tools` and `tool_choice` are plain JSON here, checked by `input_items.py` and
`tools.py` so that each 400 names the exact item and part (`input[1].content[0].type`,
`tools[0].name`) in OpenAI's words.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from argosy_runtime.server.batch.routes import MetadataKey, MetadataValue
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import VLLMExtras
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)

_FORBID = ConfigDict(extra="forbid")


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
    # OpenAI's `text.verbosity` (what GPT-5 clients send, and vLLM takes): accepted and echoed
    # without effect, like `reasoning.effort`; it was an "unknown field" 400.
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    model_config = _FORBID
    effort: str | None = None  # accepted and ignored, like chat's reasoning_effort
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(BaseModel):
    model_config = _FORBID
    include_obfuscation: StrictBool | None = None  # no obfuscation field is ever added


class ResponsesRequest(VLLMExtras):
    """POST /v1/responses (with vLLM's extras, as on chat completions)."""

    model_config = _FORBID

    model: str | None = None
    input: Any  # a string or a list of input items: checked by input_items.parse_input
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    # bounds as on chat completions (protocol._SamplingFields)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=100.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool = True
    text: TextConfig | None = None
    user: str | None = None
    # OpenAI's limits (16 pairs, keys up to 64 characters, values up to 512), as on batches
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    parallel_tool_calls: StrictBool | None = None
    tools: list[Any] | None = None  # checked by tools.function_tools
    tool_choice: Any = None  # checked by tools.chat_tool_choice
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    include: list[str] | None = None
    background: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    reasoning: Reasoning | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @field_validator("stream", "store", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        # JSON null for an optional field means "the default" (OpenAI's): `store: null` is
        # stored, as when it is left out, not false.
        return cls.model_fields[info.field_name].default if value is None else value


def reject_unsupported(req: ResponsesRequest) -> None:
    """Fields OpenAI defines that this server cannot honour: a 400 naming each."""
    if req.include:
        raise bad_request(f"include: {req.include[0]!r} is not supported", "include")
    if req.stream_options is not None and not req.stream:  # as chat completions, and OpenAI
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.background and not req.store:  # as OpenAI: it is polled by id, so it is stored
        raise bad_request("background: a background response must be stored (store: true)",
                          "background")
    if req.truncation == "auto":
        raise bad_request("truncation: 'auto' is not supported (the input is never "
                          "truncated; a too long input is a 400)", "truncation")
    if req.top_logprobs:
        raise bad_request("top_logprobs: logprobs are not supported on /v1/responses",
                          "top_logprobs")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        raise bad_request("reasoning.summary: reasoning summaries are not supported",
                          "reasoning")


def in_responses_words(message: str) -> str:
    """A chat error message in the fields of the Responses request: the 400s of
    `serving.in_responses_terms`, and the error events of a stream that failed mid-generation
    (a `text.format` schema past the matcher's limits), which come from chat worded alike."""
    message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", message)
    # chat's "response_format: json_schema.schema: ..." is the schema of text.format
    message = message.replace("response_format: json_schema.schema", "text.format.schema")
    message = message.replace("response_format: ", "text.format: ")
    return message.replace("json_schema.schema", "text.format.schema")
