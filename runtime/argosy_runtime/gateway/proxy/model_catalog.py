"""The models the gateway serves: `GET /v1/models` (and `/v1/models/{model}`), and which
configured model serves a LoRA adapter.

The list is the union of every in-rotation replica's /v1/models (their LoRA adapters among
them, each with its `parent`) plus every configured model and cascade route: a model scaled
to zero has no replica to list it, and a client that picks models from this list would
otherwise never send the request that wakes it. A request naming an adapter is routed to its
parent's pool (`adapter_parent`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from argosy_runtime.background_tasks import cancel_and_wait
from argosy_runtime.gateway.proxy.errors import model_not_found

if TYPE_CHECKING:
    from argosy_runtime.gateway.proxy.app import Gateway


class ModelCatalog:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._adapter_parents: dict[str, str] = {}  # LoRA adapter name -> configured model
        self._lookup: asyncio.Task[None] | None = None  # the last /v1/models round
        self._seen_at = 0.0

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.handle_models)
        # `.+`: a model id may hold slashes (org/model); clients send them as %2F.
        app.router.add_get("/v1/models/{model:.+}", self.handle_model)

    async def close(self) -> None:
        await cancel_and_wait(self._lookup)

    async def _replica_models(self) -> list[dict[str, Any]]:
        """Every in-rotation replica's /v1/models entries (LoRA adapters among them)."""
        session, headers = self.gateway.session, self.gateway.tenants.replica_headers
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=self.gateway.config.health.timeout_s)

        async def fetch(url: str) -> list[dict[str, Any]]:
            try:
                async with session.get(f"{url}/v1/models", timeout=timeout,
                                       headers=headers) as resp:
                    if resp.status != 200:
                        return []
                    data = await resp.json(content_type=None)
                    # Anything but a list object (another service on that port, a broken
                    # proxy) lists nothing: one odd replica must not make /v1/models, and
                    # every unknown model's lookup (_look_up_adapters), a 500 for all.
                    entries = data.get("data") if isinstance(data, dict) else None
                    return [m for m in entries or [] if isinstance(m, dict)]
            except (TimeoutError, aiohttp.ClientError, ValueError):
                return []

        urls = self.replica_urls()
        return [m for models in await asyncio.gather(*(fetch(u) for u in urls)) for m in models]

    def replica_urls(self) -> list[str]:
        """Every healthy replica, of every model, those inside a Retry-After window included:
        their queue is full, but they still list their models and answer calls on what they
        store (left out, a busy replica's stored responses, files and batches would be
        answered 404, as if gone for good)."""
        return sorted({r.url for pool in self.gateway.pools.values() for r in pool.replicas
                       if r.healthy})

    async def adapter_parent(self, model: str) -> str | None:
        """The configured model behind a LoRA adapter name: the pool one of whose replicas
        lists it in its metrics, else (an adapter added since the last health check) what the
        replicas' /v1/models say, each adapter listed with its `parent`."""
        for name, pool in self.gateway.pools.items():
            if any(model in (replica.adapters or ()) for replica in pool.replicas):
                return name
        if model not in self._adapter_parents:
            await self._look_up_adapters()
        return self._adapter_parents.get(model)

    async def _look_up_adapters(self) -> None:
        """Read every replica's /v1/models into `_adapter_parents`. A round in progress is
        shared by the requests that arrive meanwhile (they wait for it, rather than being
        told their adapter does not exist); a new one starts at most once a second."""
        lookup = self._lookup
        if lookup is None or (lookup.done() and time.monotonic() - self._seen_at > 1.0):
            self._seen_at = time.monotonic()
            lookup = self._lookup = asyncio.get_running_loop().create_task(
                self._read_adapter_parents())
        # Shielded: a client that goes away must not cancel the round the others wait on.
        await asyncio.shield(lookup)

    async def _read_adapter_parents(self) -> None:
        for m in await self._replica_models():
            parent = m.get("parent")
            if isinstance(parent, str) and parent in self.gateway.pools:
                self._adapter_parents[str(m.get("id"))] = parent

    async def _models(self) -> dict[str, dict[str, Any]]:
        """Union of every in-rotation replica's /v1/models, plus every configured model (one
        scaled to zero has no replica to list it, and a client that picks models from this
        list would otherwise never send the request that wakes it) and the cascade routes."""
        merged: dict[str, dict[str, Any]] = {}
        for m in await self._replica_models():
            merged.setdefault(str(m.get("id")), m)
        for name in [*self.gateway.pools, *self.gateway.cascades]:
            merged.setdefault(
                name,
                {"id": name, "object": "model", "created": 0, "owned_by": "argosy-gateway"},
            )
        return merged

    async def handle_models(self, request: web.Request) -> web.Response:
        models = await self._models()
        return web.json_response({"object": "list", "data": list(models.values())})

    async def handle_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model} (the openai client's models.retrieve): the same entry the
        list holds, or the 404 a request naming an unknown model gets."""
        model = request.match_info["model"]
        models = await self._models()
        if model not in models:
            return model_not_found(model, [*self.gateway.pools, *self.gateway.cascades])
        return web.json_response(models[model])
