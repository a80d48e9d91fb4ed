"""Stored responses (`store: true`, OpenAI's default), for `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}`.

In memory, per replica, least recently used first out past `max_entries` or `max_bytes`
(about what the entries' own JSON takes: a 10,000-entry bound alone let long conversations
and background runs' events grow to gigabytes): a restart loses them, and another replica
never sees them (the gateway sends every call on an id to the
replica that stored it).

Each entry keeps the conversation that led to it as chat messages (the inputs of every
response in its `previous_response_id` chain, without their `instructions`, which OpenAI
does not carry over; function calls as assistant `tool_calls`, their outputs as `tool`
messages) so that a follow-up is one lookup. The message dicts are shared between
the entries of a chain, never copied or changed, so a chain of n turns costs O(n) references
per entry, not O(n) texts.

A background response's entry also holds its run (`background.py`): its `response` changes
as the run goes, and the run keeps its stream events for replay, so they leave with the
entry.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from argosy_runtime.server.errors import APIError
from argosy_runtime.server.owners import visible_to
from argosy_runtime.server.responses.tools import chat_tool_call

if TYPE_CHECKING:
    from argosy_runtime.server.responses.background import BackgroundRun

MAX_STORED_RESPONSES = 10_000
MAX_STORED_BYTES = 1 << 30


@dataclass
class StoredResponse:
    # the response object as a client gets it now (a background run replaces it as it goes)
    response: dict[str, Any]
    # the conversation before this response's input, then its input (chat messages)
    messages: tuple[dict[str, Any], ...]
    input_items: tuple[dict[str, Any], ...]  # this request's input, as listed by input_items
    run: BackgroundRun | None = None  # a background response's generation and events
    owner: str | None = None  # the gateway tenant that created it (owners.py), if any

    def nbytes(self) -> int:
        """About the memory this entry holds of its own: its response and input as JSON, and
        a background run's events (the earlier turns' messages are shared with, and counted
        by, the entries that brought them)."""
        events = sum(len(event) for event in self.run.events) if self.run is not None else 0
        return len(json.dumps(self.response)) + len(json.dumps(self.input_items)) + events

    def conversation(self) -> tuple[dict[str, Any], ...]:
        """The messages a follow-up continues: the input so far and this response's reply
        (its text, and its function calls as chat `tool_calls`)."""
        text = output_text(self.response)
        calls = [chat_tool_call(item) for item in self.response.get("output", [])
                 if item.get("type") == "function_call"]
        if not calls:
            return (*self.messages, {"role": "assistant", "content": text})
        return (*self.messages, {"role": "assistant", "content": text or None,
                                 "tool_calls": calls})


def output_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response.get("output", [])
                   if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")


class ResponseStore:
    """An LRU of `StoredResponse` by response id (a running background response is never
    evicted)."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # response id -> nbytes() when last measured
        self.nbytes = 0  # their sum
        # Background responses still running when measured: their events grow, so they are
        # measured again once they end.
        self._growing: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        response_id = entry.response["id"]
        self._remove(response_id)
        self._entries[response_id] = entry
        self._measure(response_id)
        for rid in [rid for rid in self._growing if self._entries[rid].run.finished]:
            self._measure(rid)  # type: ignore[union-attr]
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            # The least recently used entry that is not a background response still running
            # (evicting one of those would leave its client polling a 404 while it
            # generates), and never the one just stored.
            oldest = next((rid for rid, e in self._entries.items() if rid != response_id
                           and (e.run is None or e.run.finished)), None)
            if oldest is None:
                break  # all running: the store runs over until the next put after they end
            self._remove(oldest)

    def _measure(self, response_id: str) -> None:
        entry = self._entries[response_id]
        size = entry.nbytes()
        self.nbytes += size - self._sizes.get(response_id, 0)
        self._sizes[response_id] = size
        if entry.run is not None and not entry.run.finished:
            self._growing.add(response_id)
        else:
            self._growing.discard(response_id)

    def _remove(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is not None:
            self.nbytes -= self._sizes.pop(response_id)
            self._growing.discard(response_id)

    def replace(self, old: StoredResponse, new: StoredResponse | None) -> None:
        """`new` in the place of `old` (None: forget it), only while `old` is still stored:
        a response deleted (or dropped) meanwhile stays gone."""
        response_id = old.response["id"]
        if self._entries.get(response_id) is not old:
            return
        if new is None:
            self._remove(response_id)
        else:
            self.put(new)

    def get(self, response_id: str, param: str | None = None,
            owner: str | None = None) -> StoredResponse:
        """The entry, or a 404 in OpenAI's words (`param`: the request field that named it),
        also for another owner's entry (`owner`: the one the request names, owners.py)."""
        entry = self._entries.get(response_id)
        if entry is None or not visible_to(entry.owner, owner):
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise APIError(404, f"{what} with id {response_id!r} not found (responses are "
                                "kept in memory on the replica that made them)", param=param,
                           code="previous_response_not_found" if param else "response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._remove(response_id)
