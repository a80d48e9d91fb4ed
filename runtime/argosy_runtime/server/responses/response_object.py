"""OpenAI's `Response` object, as the official client's `openai.types.responses.Response`
parses it: the generated thinking (with --reasoning-parser) and message, usage, status, and the
request's settings echoed back."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from argosy_runtime.server.responses.protocol import ResponsesRequest
from argosy_runtime.server.responses.tools import function_tools


def new_item_id(prefix: str) -> str:
    """OpenAI's ids: `resp_<hex>`, `msg_<hex>`, `rs_<hex>`, `fc_<hex>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# A request cut short by the server (a drain on SIGTERM, an abort): OpenAI's `failed`.
ABORTED = {"code": "server_error",
           "message": "the server stopped this request before it finished (it is shutting "
                      "down); send it again"}


@dataclass(frozen=True)
class Outcome:
    """How a chat answer ends as a Response: `status`, `incomplete_details`, `error`, and
    the status of its output items (an item is never `failed`, only `incomplete`)."""

    status: str
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None

    @property
    def item_status(self) -> str:
        return "incomplete" if self.status == "failed" else self.status


def outcome_of(finish_reason: str | None) -> Outcome:
    """The Response's ending for a chat finish reason."""
    if finish_reason == "length":  # max_output_tokens, or the model's context is full
        return Outcome("incomplete", {"reason": "max_output_tokens"})
    if finish_reason == "abort":
        return Outcome("failed", error=ABORTED)
    return Outcome("completed")


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant's output message; `text=None`: not started (no content part yet)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The thinking a --reasoning-parser split off (vLLM's and OpenAI's open-weight models'
    shape: the text in `content`, no `summary`); `text=None`: not started."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [reasoning_part(text)]}


def function_call_item(call: dict[str, Any], status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    """A chat tool call (`{"id", "type", "function": {"name", "arguments"}}`) as a Responses
    `function_call` output item; its `call_id` is the chat call's id."""
    function = call.get("function") or {}
    return {"id": item_id or new_item_id("fc"), "type": "function_call",
            "call_id": call["id"], "name": function.get("name", ""),
            "arguments": function.get("arguments", ""), "status": status}


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    # chat has the details only with --reasoning-parser; OpenAI's Responses usage always does
    reasoning = int((chat_usage.get("completion_tokens_details") or {})
                    .get("reasoning_tokens", 0))
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def response_object(req: ResponsesRequest, *, response_id: str, created_at: int, model: str,
                    status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None,
                    incomplete_details: dict[str, str] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    text_format = (req.text.format.model_dump(by_alias=True, exclude_none=True)
                   if req.text is not None and req.text.format is not None
                   else {"type": "text"})
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        # OpenAI's: "only present when the status is `completed`" (not when it ended
        # incomplete or failed)
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": bool(req.background),
        "error": error,
        "incomplete_details": incomplete_details,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": req.service_tier or "default",
        "store": bool(req.store),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format,
                 **({"verbosity": req.text.verbosity}
                    if req.text is not None and req.text.verbosity is not None else {})},
        "tool_choice": req.tool_choice or "auto",
        "tools": function_tools(req.tools),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }
