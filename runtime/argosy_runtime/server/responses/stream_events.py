"""Chat completion chunks rewritten as OpenAI's Responses stream events.

Each event is `event: <type>` + `data: {json}` with a `sequence_number` counting from 0, in
OpenAI's order:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added,
    response.output_text.delta (one per chat chunk that carries text),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed
    (the request ran past --request-timeout)

There is no `data: [DONE]` at the end (OpenAI sends none on this endpoint).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from argosy_runtime.server.responses.protocol import ResponsesRequest
from argosy_runtime.server.responses.response_object import (
    message_item,
    new_item_id,
    response_object,
    status_of,
    text_part,
    usage_of,
)


class ResponseEventStream:
    """One response's events; `on_done(response)` gets the finished response object (to
    store it) unless the stream failed or the client left."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str,
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.on_done = on_done
        self.item_id = new_item_id("msg")
        self.sequence_number = 0

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
        where = {"item_id": self.item_id, "output_index": 0}
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        yield self.event("response.output_item.added", output_index=0,
                         item=message_item(self.item_id, None, "in_progress"))
        yield self.event("response.content_part.added", **where, content_index=0,
                         part=text_part(""))
        parts: list[str] = []
        finish: str | None = None
        usage: dict[str, int] | None = None
        try:
            async for chunk in chat_chunks:
                data = _chat_data(chunk)
                if data is None:
                    continue
                if "error" in data:  # chat's timeout event: the response failed
                    error = data["error"]
                    text = "".join(parts)
                    output = [message_item(self.item_id, text, "incomplete")]
                    yield self.event("response.failed", response=self.response(
                        "failed", output, error={"code": "server_error",
                                                 "message": str(error.get("message"))}))
                    return
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        parts.append(delta)
                        yield self.event("response.output_text.delta", **where,
                                         content_index=0, delta=delta, logprobs=[])
                    finish = choice.get("finish_reason") or finish
        finally:
            await chat_chunks.aclose()  # type: ignore[attr-defined]
        text = "".join(parts)
        status, incomplete = status_of(finish)
        yield self.event("response.output_text.done", **where, content_index=0, text=text,
                         logprobs=[])
        yield self.event("response.content_part.done", **where, content_index=0,
                         part=text_part(text))
        item = message_item(self.item_id, text, status)
        yield self.event("response.output_item.done", output_index=0, item=item)
        final = self.response(status, [item], usage=usage_of(usage),
                              incomplete_details=incomplete)
        self.on_done(final)
        yield self.event(f"response.{status}", response=final)


def _chat_data(chunk: str) -> dict[str, Any] | None:
    """The JSON of one chat SSE chunk (None for `[DONE]` and anything that is not data)."""
    line = chunk.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    data = json.loads(line[len("data: "):])
    return data if isinstance(data, dict) else None
