"""The Responses API through the gateway (`/v1/responses`, see docs/server.md).

A replica stores the responses it makes (in memory), so:

- `POST /v1/responses` is routed like a chat completion (model, cascade rules, policy,
  streamed through); the id of a stored response comes back in the replica's
  `x-argosy-response-id` header and is remembered as living on that replica;
- one with `previous_response_id` goes to the replica holding that id (remembered, else found
  by asking the replicas in rotation, `id_owners.py`), whatever the policy would pick;
- `GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
  `POST /v1/responses/{id}/cancel` go to the replica holding the id; a background
  response's events (`GET /v1/responses/{id}?stream=true`) are relayed as they come.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.policies.base import Policy, RouteRequest
from argosy_runtime.gateway.proxy.errors import MALFORMED_JSON, error_response

if TYPE_CHECKING:
    from argosy_runtime.gateway.proxy.app import Gateway

# Set by the replica (argosy_runtime/server/responses/serving.py) on a stored response.
RESPONSE_ID_HEADER = "x-argosy-response-id"


class PinnedPolicy(Policy):
    """Only the replica at `url`: a follow-up must reach the replica holding its history."""

    name = "pinned"

    def __init__(self, url: str) -> None:
        self.url = url

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        return next((r for r in candidates if r.url == self.url), None)


class ResponsesRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        for path in ("/v1/responses/{id}", "/v1/responses/{id}/input_items"):
            app.router.add_route("GET", path, self.by_id)
        app.router.add_route("DELETE", "/v1/responses/{id}", self.by_id)
        app.router.add_post("/v1/responses/{id}/cancel", self.by_id)

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())  # aiohttp keeps the body for the relay
        except MALFORMED_JSON:
            body = None  # the generation handler answers the 400
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if not isinstance(previous, str):
            return await self.gateway.handle_generate(request)
        owner = await self.gateway.id_owners.owner("responses", previous, request.headers)
        if owner is None:
            return _not_found(previous, "previous_response_id")
        if isinstance(owner, web.Response):
            return owner
        return await self.gateway.handle_generate(request, pin=owner)

    async def by_id(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        owner = await self.gateway.id_owners.owner("responses", response_id, request.headers)
        if owner is None:
            return _not_found(response_id)
        if isinstance(owner, web.Response):
            return owner
        answer = await self.gateway.id_owners.call(request, owner, id_keys=())
        if request.method == "DELETE" and answer.status == 200:
            self.gateway.id_owners.forget(response_id)
        return answer


def _not_found(response_id: str, param: str | None = None) -> web.Response:
    what = "previous response" if param else "response"
    return error_response(404, f"no {what} with id {response_id!r} on any replica in rotation "
                               "(stored responses live in one replica's memory)", param=param,
                          code="previous_response_not_found" if param else "response_not_found")
