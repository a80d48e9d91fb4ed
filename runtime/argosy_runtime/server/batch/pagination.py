"""OpenAI's cursor pages for lists of files and batches (the gateway merges them too, so this
module imports nothing)."""

from __future__ import annotations

from typing import Any


def page(items: list[dict[str, Any]], after: str | None, limit: int,
         after_key: tuple[int, str] | None = None, descending: bool = True) -> dict[str, Any]:
    """The items after the one with id `after`, at most `limit`. `items` are in
    (`created_at`, `id`) order, `descending` or not; `after_key` is that key of `after`, for
    a cursor no longer listed (deleted since the page before: a client deleting each page as
    it goes), which then continues where it stood instead of ending the list."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after in ids:
            items = items[ids.index(after) + 1:]
        elif after_key is None:
            items = []
        else:
            items = [item for item in items
                     if ((item["created_at"], item["id"]) < after_key) == descending]
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
