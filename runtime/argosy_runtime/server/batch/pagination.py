"""OpenAI's cursor pages for lists of files and batches (the gateway merges them too, so this
module imports nothing)."""

from __future__ import annotations

from typing import Any


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """The items after the one with id `after`, at most `limit`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
