"""Chat completion chunks rewritten as OpenAI's Responses stream events.

Each event is `event: <type>` + `data: {json}` with a `sequence_number` counting from 0, in
OpenAI's order:

    response.created (status queued for a background response), response.in_progress,
    then per output item, one after another:
      the thinking (chat's reasoning_content deltas, with --reasoning-parser), as vLLM:
        response.output_item.added (a reasoning item), response.content_part.added
        (reasoning_text), response.reasoning_text.delta (one per chat chunk that carries
        thinking), response.reasoning_text.done, response.content_part.done,
        response.output_item.done
      a message (text):
        response.output_item.added, response.content_part.added,
        response.output_text.delta (one per chat chunk that carries text),
        response.output_text.done, response.content_part.done, response.output_item.done
      a function call (chat's tool_calls deltas):
        response.output_item.added (status in_progress, arguments ""),
        response.function_call_arguments.delta (one per arguments fragment),
        response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed
    (the request ran past --request-timeout, or the server cut it short: a drain, an abort)

A reply with neither thinking, text nor calls still has one (empty) message item, as
unstreamed. Chat streams a forced function's arguments as they are generated, so they come as many deltas;
calls of tool_choice "required" or parsed by --tool-call-parser come whole, one delta each.

There is no `data: [DONE]` at the end (OpenAI sends none on this endpoint).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from argosy_runtime.server.responses.protocol import ResponsesRequest, in_responses_words
from argosy_runtime.server.responses.response_object import (
    function_call_item,
    message_item,
    new_item_id,
    outcome_of,
    reasoning_item,
    reasoning_part,
    response_object,
    text_part,
    usage_of,
)
from argosy_runtime.server.tool_calls import new_call_id


class ResponseEventStream:
    """One response's events; `on_done(response)` gets the finished response object,
    whatever its status (the caller decides what to store), unless the client left."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str,
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.on_done = on_done
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # the output items so far
        self.current: dict[str, Any] | None = None  # the open one
        self.text: list[str] = []  # the open message's (or reasoning item's) text
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool call index -> its item

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any
                 ) -> dict[str, Any]:
        return response_object(self.req, response_id=self.response_id,
                               created_at=self.created_at, model=self.model, status=status,
                               output=output, **extra)

    async def translate(self, chat_chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Read chat's SSE chunks (`data: {...}`), write Responses events."""
        # A background response is created queued (it runs in the server, not the request).
        created = "queued" if self.req.background else "in_progress"
        yield self.event("response.created", response=self.response(created, []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        finish: str | None = None
        usage: dict[str, int] | None = None
        try:
            async for chunk in chat_chunks:
                data = _chat_data(chunk)
                if data is None:
                    continue
                if "error" in data:  # chat's timeout or failed-grammar event: it failed
                    message = in_responses_words(str(data["error"].get("message")))
                    yield self.failed({"code": "server_error", "message": message})
                    return
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):  # chat sends it before the answer
                        for event in self._reasoning(delta["reasoning_content"]):
                            yield event
                    if delta.get("content"):
                        for event in self._text(delta["content"]):
                            yield event
                    for call in delta.get("tool_calls") or []:
                        for event in self._call(call):
                            yield event
                    finish = choice.get("finish_reason") or finish
        finally:
            await chat_chunks.aclose()  # type: ignore[attr-defined]
        outcome = outcome_of(finish)
        if self.current is None:  # nothing generated: still one (empty) message, as unstreamed
            for event in self._open_message():
                yield event
        for event in self._close(self._last_item_status(outcome.item_status)):
            yield event
        final = self.response(outcome.status, self._output(outcome.item_status),
                              usage=usage_of(usage),
                              incomplete_details=outcome.incomplete_details, error=outcome.error)
        self.on_done(final)
        yield self.event(f"response.{outcome.status}", response=final)

    def failed(self, error: dict[str, str]) -> str:
        """The `response.failed` event ending a stream cut short (chat's timeout, or a
        background response the server stopped) with the output so far; `on_done` gets it."""
        failed = self.response("failed", self._output("incomplete"), error=error)
        self.on_done(failed)
        return self.event("response.failed", response=failed)

    # Output items open one after another, as OpenAI sends them: a message when text comes,
    # a function_call when chat starts a tool call; opening one closes the one before.

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.current["id"], "output_index": len(self.output) - 1}

    def _open_message(self) -> list[str]:
        self.current, self.text = message_item(new_item_id("msg"), None, "in_progress"), []
        self.output.append(self.current)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=self.current),
                self.event("response.content_part.added", **self._where(), content_index=0,
                           part=text_part(""))]

    def _reasoning(self, delta: str) -> list[str]:
        events = []
        if self.current is None or self.current["type"] != "reasoning":
            events = self._close("completed")
            self.current, self.text = reasoning_item(new_item_id("rs"), None, "in_progress"), []
            self.output.append(self.current)
            events += [self.event("response.output_item.added",
                                  output_index=len(self.output) - 1, item=self.current),
                       self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=reasoning_part(""))]
        self.text.append(delta)
        events.append(self.event("response.reasoning_text.delta", **self._where(),
                                 content_index=0, delta=delta))
        return events

    def _text(self, delta: str) -> list[str]:
        events = []
        if self.current is None or self.current["type"] != "message":
            events = [*self._close("completed"), *self._open_message()]
        self.text.append(delta)
        events.append(self.event("response.output_text.delta", **self._where(),
                                 content_index=0, delta=delta, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        """One chat tool_calls delta entry: the first of an index opens a function_call item
        (with chat's call id and the name), each carries an arguments fragment."""
        function = call.get("function") or {}
        events = []
        index = call.get("index", 0)
        if index not in self.calls:
            events = self._close("completed")
            self.current = function_call_item(
                {"id": call.get("id") or new_call_id(), "function": {
                    "name": function.get("name") or "", "arguments": ""}}, "in_progress")
            self.calls[index] = self.current
            self.output.append(self.current)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=self.current))
        item = self.calls[index]
        fragment = function.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=self.output.index(item),
                                     delta=fragment))
        return events

    def _close(self, status: str) -> list[str]:
        """The done events of the open item (none if none is open)."""
        item, self.current = self.current, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        if item["type"] == "function_call":
            item["status"] = status
            return [self.event("response.function_call_arguments.done", **where,
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=where["output_index"],
                               item=item)]
        text = "".join(self.text)
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            self.output[where["output_index"]] = done
            return [self.event("response.reasoning_text.done", **where, content_index=0,
                               text=text),
                    self.event("response.content_part.done", **where, content_index=0,
                               part=reasoning_part(text)),
                    self.event("response.output_item.done",
                               output_index=where["output_index"], item=done)]
        done = message_item(item["id"], text, status)
        self.output[where["output_index"]] = done
        return [self.event("response.output_text.done", **where, content_index=0, text=text,
                           logprobs=[]),
                self.event("response.content_part.done", **where, content_index=0,
                           part=text_part(text)),
                self.event("response.output_item.done", output_index=where["output_index"],
                           item=done)]

    def _last_item_status(self, status: str) -> str:
        """The open item's status at the end. Only a forced function's call streams as it is
        generated, so only it can be cut; a "required" or parsed call came whole (a dict
        tool_choice is a forced function: `chat_tool_choice` refuses any other)."""
        call = self.current is not None and self.current["type"] == "function_call"
        return "completed" if call and not isinstance(self.req.tool_choice, dict) else status

    def _output(self, status: str) -> list[dict[str, Any]]:
        """The items so far, the open one (if any) with `status`."""
        out = list(self.output)
        if self.current is not None:
            if self.current["type"] == "message":
                out[-1] = message_item(self.current["id"], "".join(self.text), status)
            elif self.current["type"] == "reasoning":
                out[-1] = reasoning_item(self.current["id"], "".join(self.text), status)
            else:
                out[-1] = {**self.current, "status": status}
        return out


def _chat_data(chunk: str) -> dict[str, Any] | None:
    """The JSON of one chat SSE chunk (None for `[DONE]` and anything that is not data)."""
    line = chunk.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    data = json.loads(line[len("data: "):])
    return data if isinstance(data, dict) else None
