"""The Responses API routes, shaped like OpenAI's so the official client's `responses`
resource works unchanged:

    POST   /v1/responses                       create (streamed or not), stored by default
    GET    /v1/responses/{id}                  a stored response
    DELETE /v1/responses/{id}                  forget it
    GET    /v1/responses/{id}/input_items      the input items it was created from
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from argosy_runtime.server.batch.pagination import page
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import ErrorResponse
from argosy_runtime.server.responses.protocol import ResponsesRequest
from argosy_runtime.server.responses.serving import create_response
from argosy_runtime.server.responses.store import ResponseStore
from argosy_runtime.server.serving_common import ServingContext
from fastapi import FastAPI, Query, Request
from starlette.responses import Response

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 429, 503)}


def add_responses_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore) -> None:
    @app.post("/v1/responses", responses=_ERRORS)
    async def create(request: Request, body: ResponsesRequest) -> Response:
        return await create_response(request, body, ctx, store)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def retrieve(response_id: str, stream: bool = False) -> dict[str, Any]:
        if stream:
            raise bad_request("stream: replaying a stored response as events is not "
                              "supported", "stream")
        return store.get(response_id).response

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
    async def input_items(response_id: str, after: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        items = list(store.get(response_id).input_items)
        return page(items if order == "asc" else items[::-1], after, limit)
