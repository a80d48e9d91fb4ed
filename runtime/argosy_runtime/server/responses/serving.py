"""POST /v1/responses on top of chat completions.

A Responses request becomes a chat completion request (instructions as a first system
message, then the stored conversation of `previous_response_id`, then the input items) and
runs through `create_chat_completion` unchanged, so chat templates, sampling, limits,
priorities, LoRA model names, metrics, disconnect aborts and errors are exactly chat's. Its
answer (a chat completion, or chat chunks when streaming) is rewritten into a `Response`
object or Responses stream events (`stream_events.py`); with `--reasoning-parser`, chat's
`reasoning_content` becomes a `reasoning` output item before the message.

A background response (`background: true`) always runs chat streamed, in a task of its own
(`background.py`) that keeps the events; the request answers at once with the `queued`
response, or follows its events when `stream` is set.
"""

from __future__ import annotations

import json
import time
from typing import Any

from argosy_runtime.server.errors import APIError, bad_request
from argosy_runtime.server.owners import OWNER_HEADER
from argosy_runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
)
from argosy_runtime.server.request_log import request_log
from argosy_runtime.server.responses.background import BackgroundRun, BackgroundRuns
from argosy_runtime.server.responses.input_items import parse_input
from argosy_runtime.server.responses.protocol import (
    ResponsesRequest,
    in_responses_words,
    reject_unsupported,
)
from argosy_runtime.server.responses.response_object import (
    function_call_item,
    message_item,
    new_item_id,
    outcome_of,
    reasoning_item,
    response_object,
    usage_of,
)
from argosy_runtime.server.responses.store import ResponseStore, StoredResponse
from argosy_runtime.server.responses.stream_events import ResponseEventStream
from argosy_runtime.server.responses.tools import chat_tool_choice, chat_tools, function_tools
from argosy_runtime.server.serving_chat import create_chat_completion
from argosy_runtime.server.serving_common import ServingContext
from argosy_runtime.server.streaming import GuardedStreamingResponse
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

# The replica tells the gateway which response it stored (gateway/proxy/responses_routes.py):
# every later call on that id must come back here.
RESPONSE_ID_HEADER = "x-argosy-response-id"

# chat's request fields -> the Responses fields the client wrote
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text"}


async def create_response(request: Request, req: ResponsesRequest, ctx: ServingContext,
                          store: ResponseStore, runs: BackgroundRuns) -> Response:
    reject_unsupported(req)
    # A gateway tenant's (owners.py): it owns what this stores and continues only its own.
    owner = request.headers.get(OWNER_HEADER)
    tools = function_tools(req.tools)
    tool_choice = chat_tool_choice(req.tool_choice, tools)
    history: tuple[dict[str, Any], ...] = ()
    if req.previous_response_id is not None:
        history = continued(store, req.previous_response_id, owner)
    parsed = parse_input(req.input, history)
    if not (req.instructions is not None or history or parsed.messages):
        # reasoning items alone: they are not shown to the model, so nothing is left to answer
        raise bad_request("input: holds no message to answer (reasoning items are not shown "
                          "to the model)", "input")
    system = [] if req.instructions is None else [{"role": "system",
                                                   "content": req.instructions}]
    chat = chat_request(req, [*system, *history, *parsed.messages], tools, tool_choice)
    response_id, created_at = new_item_id("resp"), int(time.time())
    try:
        answer = await create_chat_completion(request, chat, ctx)
    except APIError as exc:
        raise in_responses_terms(exc) from None
    # The served name chat checked (ctx.check_model's answer), not checked again: a LoRA
    # adapter unloaded while its request runs lets it finish on it (lora_admin.py), and a
    # second check after generating answered that finished response with a 404.
    model = req.model or ctx.model_name

    def stored(response: dict[str, Any]) -> StoredResponse:
        # any status, `failed` too: retrievable as it ended (`continued` refuses to continue
        # one that has no answer)
        return StoredResponse(response, (*history, *parsed.messages), tuple(parsed.items),
                              owner=owner)

    headers = {RESPONSE_ID_HEADER: response_id} if req.store else {}
    if req.background:  # chat streams (chat_request): the run reads it
        request_log(request.scope).update(stream=bool(req.stream), background=True)
        entry = stored(response_object(req, response_id=response_id, created_at=created_at,
                                       model=model, status="queued", output=[]))
        entry.run = run = BackgroundRun(entry)
        store.put(entry)
        events = ResponseEventStream(req, response_id, created_at, model, on_done=run.update)
        assert isinstance(answer, GuardedStreamingResponse)
        runs.start(run, events, answer.body_iterator, answer.close)
        # Following the run's events, a client that leaves stops nothing.
        out = (GuardedStreamingResponse(run.follow(), lambda: None) if req.stream
               else JSONResponse(entry.response))
        out.headers.update(headers)
        return out
    if isinstance(answer, GuardedStreamingResponse):
        # Stored from its start: the id its first event names is retrievable (in_progress,
        # as a background response is) while it streams. Its end replaces it, unless deleted meanwhile; if
        # the client leaves first, it is forgotten (its request was aborted).
        started = stored(response_object(req, response_id=response_id, created_at=created_at,
                                         model=model, status="in_progress", output=[]))
        if req.store:
            store.put(started)

        def close() -> None:
            answer.close()
            store.replace(started, None)  # no-op unless it never ended: the client left

        events = ResponseEventStream(req, response_id, created_at, model,
                                     on_done=lambda done: store.replace(started, stored(done)))
        out = GuardedStreamingResponse(events.translate(answer.body_iterator), close)
        out.headers.update(headers)
        return out
    if answer.status_code != 200:  # the client left (499)
        return answer
    body = json.loads(answer.body)
    choice = body["choices"][0]
    outcome = outcome_of(choice.get("finish_reason"))
    text = choice["message"].get("content") or ""
    calls = choice["message"].get("tool_calls") or []
    reasoning = choice["message"].get("reasoning_content")  # --reasoning-parser's split
    # the thinking first (when there is some: vLLM's rule), a message item when there is text
    # (or nothing else), then one item per function call; a reply cut off while it thought
    # has an incomplete reasoning item and no message, as streamed
    output = ([reasoning_item(new_item_id("rs"), reasoning,
                              "completed" if text or calls else outcome.item_status)]
              if reasoning else [])
    output += ([message_item(new_item_id("msg"), text, outcome.item_status)]
               if text or not (calls or reasoning) else [])
    # A forced function's call is the whole reply, so a reply cut short is a cut call, as
    # streamed; other calls ("required", parsed) come whole even in a reply cut short.
    call_status = (outcome.item_status if isinstance(tool_choice, NamedToolChoice)
                   else "completed")
    output += [function_call_item(call, call_status) for call in calls]
    response = response_object(
        req, response_id=response_id, created_at=created_at, model=model,
        status=outcome.status, output=output, usage=usage_of(body.get("usage")),
        incomplete_details=outcome.incomplete_details, error=outcome.error)
    if req.store:
        store.put(stored(response))
    return JSONResponse(response, headers=headers)


def continued(store: ResponseStore, response_id: str,
              owner: str | None = None) -> tuple[dict[str, Any], ...]:
    """The conversation a `previous_response_id` continues: a finished answer's only (a
    background response still running, cancelled or failed has none to continue from)."""
    previous = store.get(response_id, "previous_response_id", owner)
    status = previous.response["status"]
    if status not in ("completed", "incomplete"):
        raise bad_request(f"previous_response_id: response {response_id!r} is {status}; only "
                          "a completed or incomplete response can be continued",
                          "previous_response_id")
    return previous.conversation()


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None = None,
                 tool_choice: str | NamedToolChoice | None = None) -> ChatCompletionRequest:
    """The chat completion request that answers `req` (already checked; `tools` and
    `tool_choice` as `function_tools` and `chat_tool_choice` made them). A background
    response streams: its events are kept for replay."""
    stream = bool(req.stream or req.background)
    try:
        return ChatCompletionRequest(
            model=req.model,
            messages=[ChatMessage(**m) for m in messages],
            tools=chat_tools(tools or []),
            tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=stream,
            stream_options=StreamOptions(include_usage=True) if stream else None,
            user=req.user,
            response_format=response_format(req),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            stop_token_ids=req.stop_token_ids,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )
    except ValidationError as exc:  # bounds are checked on ResponsesRequest: not expected
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"]]
        param = _PARAMS.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{'.'.join([param or 'body', *loc[1:]])}: {error['msg']}",
                          param) from None


def response_format(req: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (constrained decoding for JSON)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "json_schema":
        # OpenAI's "text" and "json_object" formats have only `type`: a schema sent with them
        # would otherwise be ignored (and echoed back) while the output went unconstrained.
        for field, value in (("name", fmt.name), ("description", fmt.description),
                             ("schema", fmt.schema_), ("strict", fmt.strict)):
            if value is not None:
                raise bad_request(f"text.format.{field}: only allowed with type 'json_schema', "
                                  f"not {fmt.type!r}", "text")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.name is None:
        raise bad_request("text.format.name: required when type is 'json_schema'", "text")
    if fmt.schema_ is None:
        raise bad_request("text.format.schema: required when type is 'json_schema'", "text")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def in_responses_terms(exc: APIError) -> APIError:
    """A chat error named in the fields of the Responses request."""
    exc.param = _PARAMS.get(exc.param or "", exc.param)
    exc.message = in_responses_words(exc.message)
    return exc
