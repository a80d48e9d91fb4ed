"""The Responses API routes, shaped like OpenAI's so the official client's `responses`
resource works unchanged:

    POST   /v1/responses                       create (streamed or not, in the background or
                                               not), stored by default
    GET    /v1/responses/{id}                  a stored response; `stream=true` (background
                                               ones only) replays its events after
                                               `starting_after` and follows the live ones
    POST   /v1/responses/{id}/cancel           cancel a background response
    DELETE /v1/responses/{id}                  forget it (a background one still running is
                                               cancelled first)
    GET    /v1/responses/{id}/input_items      the input items it was created from

A request naming an owner (a gateway tenant's, owners.py) stores that owner's responses and
reaches only those: another owner's id is the same 404 as an unknown one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from argosy_runtime.server.batch.pagination import page
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.owners import Owner
from argosy_runtime.server.protocol import ErrorResponse
from argosy_runtime.server.responses.background import BackgroundRun, BackgroundRuns
from argosy_runtime.server.responses.protocol import ResponsesRequest
from argosy_runtime.server.responses.serving import create_response
from argosy_runtime.server.responses.store import ResponseStore
from argosy_runtime.server.serving_common import ServingContext
from argosy_runtime.server.streaming import GuardedStreamingResponse
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 429, 503)}


def add_responses_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore,
                         runs: BackgroundRuns) -> None:
    @app.post("/v1/responses", responses=_ERRORS)
    async def create(request: Request, body: ResponsesRequest) -> Response:
        return await create_response(request, body, ctx, store, runs)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def retrieve(response_id: str, stream: bool = False,
                       starting_after: Annotated[int | None, Query(ge=0)] = None,
                       owner: Owner = None) -> Response:
        entry = store.get(response_id, owner=owner)
        if not stream:
            return JSONResponse(entry.response)
        run = _background(entry.run, "stream", "only a background response can be streamed "
                                               "on retrieve")
        # Leaving this stream stops nothing: the run goes on.
        return GuardedStreamingResponse(
            run.follow(-1 if starting_after is None else starting_after), lambda: None)

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel(response_id: str, owner: Owner = None) -> dict[str, Any]:
        entry = store.get(response_id, owner=owner)
        # As OpenAI: a finished background response comes back unchanged (a second cancel
        # is a no-op).
        await _background(entry.run, None, "only a background response can be "
                                           "cancelled").cancel()
        return entry.response

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete(response_id: str, owner: Owner = None) -> dict[str, Any]:
        run = store.get(response_id, owner=owner).run
        if run is not None:  # nobody could see or cancel it any more
            await run.cancel()
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
    async def input_items(response_id: str, after: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          order: Literal["asc", "desc"] = "desc",
                          owner: Owner = None) -> dict[str, Any]:
        items = list(store.get(response_id, owner=owner).input_items)
        return page(items if order == "asc" else items[::-1], after, limit)


def _background(run: BackgroundRun | None, param: str | None, message: str) -> BackgroundRun:
    """The run of a background response, or a 400: this one was not made with background."""
    if run is None:
        raise bad_request(f"{message}; this one was not created with background: true",
                          param)
    return run
