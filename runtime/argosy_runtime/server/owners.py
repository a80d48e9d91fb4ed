"""Who owns a stored object (a Batch API file or batch, a stored Response).

A gateway with tenants names the tenant on every request it forwards, in the `X-Argosy-Owner`
header (it sets the header itself and drops any value a client sent, gateway/proxy/
tenant_gate.py). A replica records that owner on what the request creates, and a request
that names an owner sees only that owner's objects: another owner's id answers the same 404
as an unknown one, so ids neither leak nor can be probed. A request without the header (an
open gateway, a direct call with the replica's API key, the batch runner's calls of a batch
made without one) sees everything; an object stored without an owner (before owners were
recorded, or through an open gateway) is visible to every owner.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header
from starlette.requests import Request

OWNER_HEADER = "X-Argosy-Owner"

# A route's parameter for the owner its request names (None: any). `alias`: the parameter is
# called `owner`, the header is not.
Owner = Annotated[str | None, Header(alias=OWNER_HEADER, include_in_schema=False)]


def owner_of(request: Request) -> str | None:
    """The owner a request names (its `X-Argosy-Owner`), for handlers that do not take the
    `Owner` parameter."""
    return request.headers.get(OWNER_HEADER)


def cache_salt_of(owner: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request naming `owner` and sending `salt` (vLLM's
    `cache_salt`): each owner's requests share cached prompts only with each other, as
    OpenAI keeps prompt caches per organization (another tenant's `usage.cached_tokens`, or
    its time to first token, would otherwise tell what prompts this one sent). A header
    value holds no NUL, so no owner's salt equals another's; a request naming no owner gets
    an empty owner part, so its salt cannot spell an owner's ("alice\0x" was alice's "x")."""
    if owner is None:
        return None if salt is None else f"\0{salt}"
    return f"{owner}\0{salt or ''}"


def visible_to(record_owner: str | None, owner: str | None) -> bool:
    """May a request naming `owner` see an object recorded as `record_owner`'s?"""
    return owner is None or record_owner is None or record_owner == owner


def public(record: dict[str, Any]) -> dict[str, Any]:
    """A stored record as clients get it: OpenAI's object, without our `owner` field."""
    return {k: v for k, v in record.items() if k != "owner"}
