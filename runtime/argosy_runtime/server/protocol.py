"""OpenAI request and response schemas (pydantic), plus vLLM's widely used extras.

Requests forbid unknown fields (`extra="forbid"`): a misspelled option is a 400, never silently
ignored. The accepted extras are exactly vLLM's `ignore_eos`, `min_tokens`, `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids` (see DESIGN.md), `priority` (scheduling order),
`include_stop_str_in_output` and, on chat, `chat_template_kwargs`, `add_generation_prompt`
and `continue_final_message`, so clients written for vLLM work unchanged. OpenAI fields we accept but do not act on (`user`, `store`, `metadata`,
...) are listed explicitly; OpenAI fields we cannot honour (`suffix`,
`tool_choice: "auto"`, ...) are rejected with a 400 naming them (see
`serving_common.reject_unsupported`). `structured_outputs` is vLLM's constrained-decoding
extra; OpenAI's `response_format` does the same for JSON, and `tools` with `tool_choice`
"required" or a named function use it too (`tool_calls.py`). Completions and chat also take
vLLM's `allowed_token_ids`, `bad_words` (SamplingParams) and `truncate_prompt_tokens`
(`serving_common.truncate_prompts`, shared with the pooling routes).

Numeric bounds here mirror `SamplingParams` so that they also appear in the OpenAPI document.
Token ids and counts are `StrictInt`: pydantic's lax `int` takes `true` as 1 and `1.0` as 1,
so `prompt: [true, false]` would run as token ids 1 and 0. Float fields (sampling values,
penalties, `logit_bias` values) are `StrictFloat`: lax `float` takes `true` as 1.0 and "0.5"
as 0.5; pydantic 2's strict float still takes an int (5 is fine, `true` and "5" are not;
pydantic 1's StrictFloat refused ints, but this module needs pydantic 2).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from argosy_runtime.sampling_params import MAX_LOGPROBS, MAX_N, MIN_REPETITION_PENALTY
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

_FORBID = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = _FORBID
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False
    # OpenAI's (chat and completions alike): padding against size side channels. Accepted,
    # and no `obfuscation` field is ever added, as on /v1/responses.
    include_obfuscation: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` (OpenAI): the schema the reply must match."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = _FORBID
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint (json, regex, choice, grammar,
    json_object), and vLLM's options for it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: StrictStr | None = None
    disable_additional_properties: StrictBool = False
    # vLLM's: do not retry with another backend when the first cannot compile the spec.
    # Argosy has one backend (llguidance) and never falls back: accepted, nothing to do.
    disable_fallback: StrictBool = False
    # vLLM's tool-call tags in free text: not supported, a 400 naming it
    # (serving_common.structured_outputs_of) rather than "unknown field".
    structural_tag: Any = None


class VLLMExtras(BaseModel):
    """vLLM's request extras (DESIGN.md) and its scheduling priority, on completions, chat
    completions and responses alike."""

    model_config = _FORBID

    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, ge=MIN_REPETITION_PENALTY,
                                                   le=100.0)
    stop_token_ids: list[StrictInt] | None = None
    # Lower runs earlier, and may preempt requests of a higher value when the batch is full.
    # Strict: "1", 1.5 or true is a 400, not a silent coercion.
    priority: StrictInt = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)
    # Requests with another salt share no prefix-cache blocks with this one (vLLM's; one per
    # tenant keeps tenants from timing each other's cached prompts).
    cache_salt: str | None = Field(default=None, min_length=1)


class _SamplingFields(VLLMExtras):
    """Fields shared by completions and chat completions."""

    model_config = _FORBID

    model: str | None = None
    n: StrictInt | None = Field(default=1, ge=1, le=MAX_N)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=100.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    # vLLM's: the reply keeps the stop string (or stop token's text) that ended it
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: only these token ids may be sampled; words never generated (bad_words.py);
    # keep the last k prompt tokens (-1: as many as fit beside max_tokens).
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    # vLLM's beam search: n is the beam width, the n best hypotheses the choices
    # (serving_beam_search.py); length_penalty divides a hypothesis's summed log-probability
    # by its length to this power.
    use_beam_search: StrictBool = False
    # vLLM's: each prompt token's logprob and the top k there, in the reply (not with stream)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    length_penalty: StrictFloat = Field(default=1.0, ge=-100.0, le=100.0)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # 0 only with echo: the prompt (and its logprobs) alone, OpenAI's legacy scoring idiom
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's), plus vLLM's `priority` and `truncate_prompt_tokens`."""

    model_config = _FORBID
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    # vLLM's: keep the last k tokens of each input (an encoder's [CLS] ... [SEP] cut); -1:
    # the model's length; 0 or null: all of it.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    user: str | None = None
    priority: StrictInt = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)


class ContentPart(BaseModel):
    model_config = _FORBID
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """An assistant's refusal sent back with the history (OpenAI's): read as its text."""

    model_config = _FORBID
    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    """One chat message; content may be a string or a list of text (or refusal) parts."""

    model_config = _FORBID
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart | RefusalPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    # An assistant reply's thinking as a reasoning parser returned it, sent back with the
    # history: passed to the template, which decides (most drop earlier turns' thinking;
    # Qwen3's shows that of the turns after the last user message, as in a tool-call chain).
    reasoning_content: str | None = None
    # Fields of a reply message (OpenAI's and vLLM's) that a client sends back with the
    # history as it got them (`message.model_dump()` sets them all, mostly to null). Citations
    # do not change the text, so they are dropped; a previous audio reply or a legacy
    # function call cannot be shown to the model, so only null is accepted for those.
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _no_media_parts(cls, content: Any) -> Any:
        """An image, audio or file part would otherwise fail every branch of the union, and
        pydantic reports the first: "content.str: Input should be a valid string"."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "refusal"):
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "part {i} has type '{kind}': this model reads text only (send 'text' "
                    "parts)", {"i": i, "kind": kind})
        return content

    @field_validator("audio", "function_call", mode="before")
    @classmethod
    def _only_null(cls, value: Any, info: ValidationInfo) -> Any:
        """Clearer than pydantic's "Input should be None"."""
        if value is not None:
            raise PydanticCustomError(
                "unsupported_reply_field",
                "{field} of an earlier reply cannot be shown to this model (only null is "
                "accepted): send its text as content, a function call as tool_calls",
                {"field": info.field_name})
        return value


class FunctionDefinition(BaseModel):
    model_config = _FORBID
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    """One entry of `tools` (only function tools exist in the chat API)."""

    model_config = _FORBID
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _FORBID
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` forcing one function: {"type": "function", "function": {"name": ...}}."""

    model_config = _FORBID
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    # OpenAI's end-user tag (`user`'s successor) and prefix-cache routing hint: accepted and
    # ignored, as `user` is (the prefix cache needs no hint; cache_salt separates tenants).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's: extra variables for the chat template (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: render without the assistant turn's opening, or leave the final message open
    # for the model to continue (an assistant prefill: "{"; "Sure, here is").
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template."""

    model_config = _FORBID
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: StrictBool = True  # messages only
    continue_final_message: StrictBool = False  # messages only, as chat's
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    chat_template_kwargs: dict[str, Any] | None = None  # messages only, as chat's


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = _FORBID
    model: str | None = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's)."""

    model_config = _FORBID
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    lora_int_id: StrictInt | None = None  # vLLM's; accepted for compatibility, unused


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    model_config = _FORBID
    lora_name: str = Field(min_length=1)
    lora_int_id: StrictInt | None = None


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens inside the thinking (--reasoning-parser)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # chat completions on a server with --reasoning-parser only
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "argosy"
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
