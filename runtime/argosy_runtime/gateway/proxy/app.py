"""The gateway app: OpenAI endpoints proxied to replicas, plus /health, /ready, /metrics.

    POST /v1/completions, /v1/chat/completions   routed (cascade, then policy), streamed through
    POST /v1/responses                           the same; a previous_response_id follow-up, and
    GET/DELETE /v1/responses/{id}                calls on a stored response, go to its replica
    POST /v1/embeddings                          routed by model and policy (no cascade), relayed
    POST /v1/score, /v1/rerank (/score, /rerank, /v2/rerank)   the same
    POST /v1/classify (/classify)                the same
    GET  /v1/models                              merged across all replicas and cascade routes
    /v1/files, /v1/batches                       the Batch API, to the replica holding each id
    GET  /health                                 the gateway process is up
    GET  /ready                                  every model has a healthy replica (or can wake)
    GET  /metrics                                the gateway's Prometheus metrics

With `tenants` configured, every /v1/* request needs a tenant's key and generation (and
embeddings) requests are admitted against the tenant's limits first (tenant_gate.py).

Answers are relayed chunk by chunk as they arrive (SSE events are never re-parsed or buffered).
The app runs with handler cancellation on: when a client disconnects, its handler is cancelled,
the upstream connection is closed, and the replica aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from argosy_runtime.gateway import cascade as cascade_rules
from argosy_runtime.gateway.activation import Activator, kubernetes_signal
from argosy_runtime.gateway.backends.discovery import Discovery, make_discovery
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.config import GatewayConfig
from argosy_runtime.gateway.health import HealthChecker
from argosy_runtime.gateway.metrics import GatewayMetrics
from argosy_runtime.gateway.policies import RouteRequest
from argosy_runtime.gateway.proxy.batch_routes import BatchRoutes
from argosy_runtime.gateway.proxy.errors import (
    MALFORMED_JSON,
    bad_request,
    error_response,
    malformed_json,
    model_not_found,
    no_replica,
    retry_after_value,
)
from argosy_runtime.gateway.proxy.headers import to_client, to_replica
from argosy_runtime.gateway.proxy.id_owners import IdOwners
from argosy_runtime.gateway.proxy.middlewares import (
    body_timeout,
    internal_error,
    unreadable_body,
)
from argosy_runtime.gateway.proxy.model_catalog import ModelCatalog
from argosy_runtime.gateway.proxy.relay import BROKEN, CLIENT_CLOSED, UNEXPECTED, relay
from argosy_runtime.gateway.proxy.responses_routes import (
    RESPONSE_ID_HEADER,
    PinnedPolicy,
    ResponsesRoutes,
)
from argosy_runtime.gateway.proxy.tenant_gate import TenantGate
from argosy_runtime.gateway.proxy.upstream import Upstream, send
from argosy_runtime.gateway.request_text import POOLING_PATHS, routing_text
from argosy_runtime.gateway.routing import Routing
from argosy_runtime.gateway.tenants.config_file import ConfigFile
from argosy_runtime.gateway.tenants.key_files import POLL_SECONDS
from argosy_runtime.server.owners import OWNER_HEADER

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


class Gateway:
    """Pools, policies, health checks and metrics behind one aiohttp application."""

    def __init__(self, config: GatewayConfig, *, keys_poll_s: float = POLL_SECONDS,
                 config_file: ConfigFile | None = None) -> None:
        """`config_file`: the file `config` was read from, whose `tenants` and `routing`
        (with the models' `policy`) apply while the gateway runs; `keys_poll_s`: how often it
        and the tenants' `api_keys_file`s are re-read (tests shorten it)."""
        self.config = config  # as started: its tenants and routing may have been reloaded since
        self.config_file = config_file
        self.pools: dict[str, ReplicaPool] = {m.name: ReplicaPool(m.name) for m in config.models}
        # The routing settings and policies in force (replaced whole by `apply_routing`).
        self.routing = Routing.of(config)
        self.cascades = {c.name: c for c in config.cascades}
        # Scale from zero: models whose requests wait for a replica instead of a 503.
        self.activators: dict[str, Activator] = {
            m.name: Activator(self.pools[m.name], m.activation)
            for m in config.models
            if m.activation is not None
        }
        self.metrics = GatewayMetrics(
            lambda: list(self.pools.values()), lambda: list(self.activators.values())
        )
        # API keys and per-tenant limits (a no-op without `tenants`).
        self.tenants = TenantGate(config.tenants, self.metrics, config.replica_api_key,
                                  keys_poll_s=keys_poll_s, config_file=config_file,
                                  apply_config=self.apply_routing)
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self._discoveries: list[Discovery] = []
        # The models served (/v1/models) and the LoRA adapters' parent models.
        self.catalog = ModelCatalog(self)
        # Replicas holding Batch API files and batches, and stored responses, by id.
        self.id_owners = IdOwners(self)
        # The tasks of the requests being handled, which the drain cuts at its deadline.
        self._handling: set[asyncio.Task[Any]] = set()
        self._drain_deadline: asyncio.TimerHandle | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream session, start discovery and health checks."""
        self.session = aiohttp.ClientSession(
            # Idle keep-alive connections are dropped before uvicorn's own 5 s timeout would
            # close them under us (a send on a just-closed connection fails).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0),
            auto_decompress=False,  # relay bytes exactly as the replica sent them
        )
        for route in self.config.models:
            discovery = make_discovery(route, self.pools[route.name], self.session)
            discovery.start()
            self._discoveries.append(discovery)
            if route.name in self.activators and route.kubernetes is not None:
                self.activators[route.name].signal = kubernetes_signal(
                    route.kubernetes, self.session
                )
        self.health = HealthChecker(lambda: list(self.pools.values()), self.config.health, self.session)
        self.health.start()

    def start_drain(self) -> None:
        """Cut the requests still being handled `drain_timeout_s` from now. aiohttp's own
        drain (runner.cleanup) waits that long, but past it only wakes a handler reading the
        client's body: one relaying a replica's answer ran on for another `drain_timeout_s`
        (a 30 s drain lasted 60 s, past the pod's grace period, so the kubelet's SIGKILL
        ended it), and a drain of 0 waited for every answer to end."""

        def cut() -> None:
            for task in self._handling:
                task.cancel()  # as a client leaving: the replica aborts, the client is cut

        self._drain_deadline = asyncio.get_running_loop().call_later(
            self.config.drain_timeout_s, cut)

    async def close(self) -> None:
        if self._drain_deadline is not None:
            self._drain_deadline.cancel()
        for activator in self.activators.values():
            await activator.close()
        if self.health is not None:
            await self.health.stop()
        for discovery in self._discoveries:
            await discovery.stop()
        await self.catalog.close()
        if self.session is not None:
            await self.session.close()

    def make_app(self) -> web.Application:
        limit = MAX_BODY_BYTES

        @web.middleware
        async def body_too_large(request: web.Request, handler: Any) -> web.StreamResponse:
            # aiohttp refuses a body over `client_max_size` (raised where a handler reads it)
            # with a plain-text 413; answer the runtime server's OpenAI-shaped one instead.
            # Outermost, so the tenants' gate inside it still counts the 413.
            try:
                return await handler(request)
            except web.HTTPRequestEntityTooLarge:
                return error_response(
                    413, f"request body is larger than this gateway's limit of {limit} bytes "
                         f"({limit / 2**20:g} MiB)", code="request_too_large")

        @web.middleware
        async def tracked(request: web.Request, handler: Any) -> web.StreamResponse:
            # Outermost, so that the drain's deadline (start_drain) cuts all of a request.
            task = asyncio.current_task()
            assert task is not None
            self._handling.add(task)
            try:
                return await handler(request)
            finally:
                self._handling.discard(task)

        # Inside `tracked`: the tenants' gate inside counts a failed request as its 500.
        app = web.Application(client_max_size=limit,
                              middlewares=[tracked, internal_error, body_too_large])
        self.tenants.install(app)
        # Innermost, so that the tenants' gate counts (and releases) a 408 or 400 like any
        # answer.
        app.middlewares.extend([body_timeout(self.config.client_body_timeout_s),
                                unreadable_body])
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        for path in POOLING_PATHS:  # /v1/embeddings, scores, reranks, classifications
            app.router.add_post(path, self.handle_generate)
        self.catalog.add_to(app)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        BatchRoutes(self).add_to(app)
        ResponsesRoutes(self).add_to(app)
        app.router.add_route("*", "/{tail:.*}", self.handle_unknown)

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_shutdown(_: web.Application) -> None:
            # runner.cleanup: no longer accepting, the answers in flight not yet waited for
            self.start_drain()

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)
        app.on_cleanup.append(on_cleanup)
        return app

    def apply_routing(self, config: GatewayConfig) -> None:
        """Route with a reloaded config's `routing` and models' `policy` from the next request
        on (gateway/routing.py says what carries over). One assignment, no await: requests
        already routing finish with the snapshot they started with."""
        new = self.routing.reloaded(config)
        if new is self.routing:
            return
        changes = self.routing.changes(new)
        self.routing = new
        where = self.config_file.path if self.config_file is not None else "config"
        logger.info("%s: routing reloaded (%s)", where, "; ".join(changes))

    # -- small endpoints ---------------------------------------------------------------------

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        # Healthy replicas, cooling down after a 429's (or a draining 503's) Retry-After
        # included: they are busy, not gone, and their clients get the gateway's 429 with
        # Retry-After. Counted out, a load spike would pull the gateway from its Service's
        # endpoints, and every model's clients would find no gateway instead.
        per_model = {name: sum(r.healthy for r in pool.replicas)
                     for name, pool in self.pools.items()}
        # A model that scales from zero is served with no replica too: the gateway must stay
        # in its Service's endpoints, or no request could ever reach it to wake the model.
        ready = bool(per_model) and all(
            count or name in self.activators for name, count in per_model.items()
        )
        return web.json_response(
            {"ready": ready, "replicas_in_rotation": per_model}, status=200 if ready else 503
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def handle_unknown(self, request: web.Request) -> web.Response:
        """404, or 405 with `Allow` when the path exists for other methods (GET
        /v1/chat/completions), as the runtime server answers: aiohttp tries this catch-all
        route after a path whose method did not match, which would say "not found"."""
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource is not request.match_info.route.resource:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            return error_response(
                405, f"method not allowed: {request.method} {request.path} (allowed: "
                     f"{', '.join(sorted(allowed))})",
                headers={"Allow": ", ".join(sorted(allowed))})
        return error_response(404, f"not found: {request.method} {request.path}")

    # -- generation --------------------------------------------------------------------------

    async def handle_generate(
        self, request: web.Request, pin: str | None = None
    ) -> web.StreamResponse:
        """Route and relay one generation (or embeddings) request; `pin`: the URL of the only
        replica that may answer (a Responses API follow-up goes where its history is
        stored)."""
        started = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except MALFORMED_JSON as exc:
            return malformed_json(exc)
        if not isinstance(body, dict):
            return bad_request("body: the request body must be a JSON object")
        model = body.get("model")
        if model is None and len(self.pools) == 1 and not self.cascades:
            # Like the server: one model, so `model` may be left out (the replica defaults it).
            model = next(iter(self.pools))
        if not isinstance(model, str) or not model:
            return bad_request("model: a model name is required", param="model")
        changed = self.tenants.apply_priority(request, body)
        changed = self.tenants.ask_for_usage(request, body) or changed
        if changed:  # every route below sends `body` (or a copy) as it is now
            raw = json.dumps(body).encode()
        path = request.path
        headers = to_replica(request.headers)

        route_name, forced_tier = cascade_rules.split_route_name(model)
        cascade = self.cascades.get(route_name)
        if cascade is None:
            pool = model if model in self.pools else await self.catalog.adapter_parent(model)
            if pool is None:
                return model_not_found(model, [*self.pools, *self.cascades])
            if pin is not None and pin not in {r.url for r in self.pools[pool].replicas}:
                return bad_request(
                    f"previous_response_id: that response is stored by a replica that does "
                    f"not serve {model!r}; continue it with the model that made it",
                    param="previous_response_id",
                )
            # A LoRA adapter goes to its base model's replicas that serve it, its name unchanged.
            adapter = model if pool != model else None
            return await self._relay(request, pool, path, body, raw, headers, started, {},
                                     adapter, pin)
        if pin is not None:
            return bad_request(
                f"previous_response_id: {route_name!r} is a cascade route; continue a stored "
                "response with the model that made it",
                param="previous_response_id",
            )
        if path in POOLING_PATHS:
            # Vectors of two models live in different spaces: a cascade's answers, some from
            # the small model and some from the large, could not be compared with each other
            # (nor scores made of them; nor one classifier's labels with another's).
            return bad_request(
                f"model: {route_name!r} is a cascade route, which answers generation requests "
                f"only; ask for embeddings, scores or classes with one model ({cascade.small!r} or "
                f"{cascade.large!r})",
                param="model",
            )

        decision = cascade_rules.decide(cascade, path, body, request.headers, forced_tier)
        extra = {"x-argosy-cascade": decision.tier, "x-argosy-cascade-reason": decision.reason}
        routed = dict(body, model=decision.model)

        async def large_instead(reason: str, headers_extra: dict[str, str] | None = None
                                ) -> web.StreamResponse:
            self.metrics.cascade_decisions.labels(cascade.name, "large", reason).inc()
            large = dict(body, model=cascade.large)
            return await self._relay(
                request, cascade.large, path, large, json.dumps(large).encode(), headers,
                started, {"x-argosy-cascade": "large", "x-argosy-cascade-reason": reason,
                          **(headers_extra or {})})

        # The small model chosen by the rules (not asked for by the client) that cannot take
        # the request (no replica, all busy or failing) is no answer: the large one gives it.
        can_fall_back = decision.tier == "small" and decision.reason not in (
            cascade_rules.REASON_HEADER, cascade_rules.REASON_MODEL_NAME)
        # The confidence check reads chat/completions logprobs; a Responses request has none.
        if not decision.check_confidence or path == "/v1/responses":
            raw = json.dumps(routed).encode()
            upstream = await self._send(decision.model, path, routed, raw, headers,
                                        fallback=can_fall_back)
            if can_fall_back and cascade_rules.unavailable(upstream):
                return await large_instead(cascade_rules.REASON_SMALL_UNAVAILABLE)
            self.metrics.cascade_decisions.labels(cascade.name, decision.tier, decision.reason).inc()
            return await self._relay_upstream(request, decision.model, path, routed, upstream,
                                              started, extra)

        # Non-streamed and a confidence threshold is set: ask the small model for logprobs,
        # read its whole answer, and decide whether the large model must answer instead.
        asked, added = cascade_rules.request_logprobs(path, routed)
        upstream = await self._send(decision.model, path, asked, json.dumps(asked).encode(),
                                    headers, fallback=can_fall_back)
        if isinstance(upstream, web.Response):
            if can_fall_back and cascade_rules.unavailable(upstream):
                return await large_instead(cascade_rules.REASON_SMALL_UNAVAILABLE)
            self.metrics.cascade_decisions.labels(cascade.name, decision.tier, decision.reason).inc()
            upstream.headers.update(extra)
            return upstream
        status = upstream.response.status
        try:
            data: bytes | None = upstream.first_chunk + await upstream.response.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            logger.warning("small model's replica broke mid-answer: %r", exc)
            data = None  # nothing reached the client yet: the large model answers instead
        except asyncio.CancelledError:
            # The client went away while the small model's answer was read: a 499, as a
            # client leaving mid-answer counts anywhere else (_relay_upstream).
            self.count(decision.model, upstream.replica.url, CLIENT_CLOSED)
            raise
        finally:
            upstream.release()
        answer: Any = None
        if data is not None and status == 200:
            with contextlib.suppress(*MALFORMED_JSON):  # not JSON: judged like no logprobs
                answer = json.loads(data)
        confidence = cascade_rules.mean_logprob(answer) if isinstance(answer, dict) else None
        assert cascade.min_mean_logprob is not None
        low = confidence is not None and confidence < cascade.min_mean_logprob
        if data is None or low:
            reason = cascade_rules.REASON_LOW_CONFIDENCE if low else cascade_rules.REASON_SMALL_FAILED
            return await large_instead(reason, {} if confidence is None else {
                "x-argosy-cascade-confidence": f"{confidence:.4f}"})
        if status != 200:  # the client's own error (4xx): pass it through as the server said it
            reason = decision.reason
        elif confidence is None:
            reason = cascade_rules.REASON_NO_LOGPROBS
        else:
            reason = cascade_rules.REASON_CONFIDENT
        self.metrics.cascade_decisions.labels(cascade.name, "small", reason).inc()
        extra["x-argosy-cascade-reason"] = reason
        if confidence is not None:
            extra["x-argosy-cascade-confidence"] = f"{confidence:.4f}"
        if isinstance(answer, dict) and added:
            data = json.dumps(cascade_rules.strip_logprobs(answer)).encode()
        self._count(decision.model, upstream, status, started)
        charged = self.tenants.meter(request, path, asked, status, upstream.response.content_type)
        charged.feed(data)
        charged.finish()
        out = web.Response(status=status, body=data, headers=extra)
        out.headers["Content-Type"] = upstream.response.headers.get(
            "Content-Type", "application/json"
        )
        out.headers["x-argosy-backend"] = upstream.replica.url
        return out

    async def _send(
        self,
        model: str,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        headers: Mapping[str, str],
        adapter: str | None = None,
        pin: str | None = None,
        *,
        fallback: bool = False,
    ) -> Upstream | web.Response:
        """Send to one of `model`'s replicas: its open answer, or the error to answer instead.
        `fallback`: a cascade's large model answers when this one cannot take the request
        (cascade_rules.unavailable); that refusal is then not counted, the large model's
        answer is (each request once in argosy:gateway_requests_total)."""
        assert self.session is not None

        def refused(response: web.Response) -> web.Response:
            if not (fallback and cascade_rules.unavailable(response)):
                self.count(model, "", str(response.status))
            return response

        try:
            activator = self.activators.get(model)
            if activator is not None and activator.needed():
                held = await self._hold(model, activator)
                if held is not None:
                    return refused(held)
            pinned = self.pools[model].get(pin) if pin is not None else None
            if pinned is not None and pinned.healthy and not pinned.is_available():
                # The only replica that may answer is inside its Retry-After window: busy,
                # so the client's 429 with what is left of it (not a 503 that says the
                # model has no replica).
                return refused(error_response(
                    429, f"the replica holding this conversation ({pin}) is busy; retry later",
                    headers={"Retry-After": retry_after_value(
                        pinned.cooldown_until - time.monotonic())}))
            routing = self.routing  # one snapshot for all of this request's tries
            route = RouteRequest(
                prefix=routing_text(path, body)[: routing.config.max_prefix_chars], adapter=adapter,
                # The tenant (set by the tenants' gate, never by a client): its prompts place
                # only its own requests (policies/prefix_affinity.py, `routing_salt`).
                owner=next((v for k, v in headers.items() if k.lower() == OWNER_HEADER.lower()),
                           None),
                # a non-string salt is the replica's 400, whatever the route
                cache_salt=salt if isinstance(salt := body.get("cache_salt"), str) else None,
                cache_key=key if isinstance(key := body.get("prompt_cache_key"), str) else None,
            )
            result = await send(
                session=self.session,
                config=self.config,
                metrics=self.metrics,
                pool=self.pools[model],
                policy=routing.policies[model] if pin is None else PinnedPolicy(pin),
                route=route,
                path=path,
                body=raw,
                headers=headers,
                adapter=adapter,
            )
        except asyncio.CancelledError:
            # The client went away while its request was held or before the replica's
            # first byte: counted as the 499 a client leaving mid-answer counts as
            # (_relay_upstream), also in argosy:gateway_client_disconnects_total, so that
            # every request the gateway took is counted once.
            self.count(model, "", CLIENT_CLOSED)
            raise
        if isinstance(result, web.Response):
            return refused(result)
        return result

    async def _hold(self, model: str, activator: Activator) -> web.Response | None:
        """Wait for a replica of a model that has none (scale from zero); None once one is in
        rotation, else the 503 to answer."""
        if activator.full:
            return no_replica(model)
        started = time.monotonic()
        if not await activator.wait():
            if activator.unreachable is not None:
                return error_response(503, activator.unreachable, headers={"Retry-After": "60"})
            self.metrics.activation_timeouts.labels(model).inc()
            return error_response(
                503,
                f"no replica of {model!r} became ready within {activator.config.timeout_s:g} s "
                "(it is scaled to zero or starting); retry later",
                headers={"Retry-After": "10"},
            )
        self.metrics.activation_wait.labels(model).observe(time.monotonic() - started)
        return None

    def count(self, model: str, backend: str, code: str) -> None:
        """One request in argosy:gateway_requests_total (`code`: relay.py); a client that
        left (499) also in argosy:gateway_client_disconnects_total."""
        self.metrics.requests.labels(model, backend, code).inc()
        if code == CLIENT_CLOSED:
            self.metrics.client_disconnects.labels(model).inc()

    def _count(self, model: str, upstream: Upstream, status: int, started: float) -> None:
        self.count(model, upstream.replica.url, str(status))
        self.metrics.latency.labels(model).observe(time.monotonic() - started)

    def count_by_id(self, backend: str, code: str) -> None:
        """Count a call on a stored object (a Batch API file or batch, a stored response)
        that the replica at `backend` answered, under the model whose replica that is;
        `code` as for generations (relay.py)."""
        model = next((name for name, pool in self.pools.items()
                      if pool.get(backend) is not None), "")
        self.count(model, backend, code)

    async def _relay(
        self,
        request: web.Request,
        model: str,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        headers: Mapping[str, str],
        started: float,
        extra: dict[str, str],
        adapter: str | None = None,
        pin: str | None = None,
    ) -> web.StreamResponse:
        """Send to a replica and stream its answer to the client as it arrives."""
        upstream = await self._send(model, path, body, raw, headers, adapter, pin)
        return await self._relay_upstream(request, model, path, body, upstream, started, extra)

    async def _relay_upstream(
        self,
        request: web.Request,
        model: str,
        path: str,
        body: dict[str, Any],
        upstream: Upstream | web.Response,
        started: float,
        extra: dict[str, str],
    ) -> web.StreamResponse:
        """Stream a sent request's answer (or the error `_send` gave instead) to the client."""
        if isinstance(upstream, web.Response):
            upstream.headers.update(extra)
            return upstream
        resp = upstream.response
        stored = resp.headers.get(RESPONSE_ID_HEADER)
        if stored and resp.status == 200:  # later calls on this response must come here
            self.id_owners.remember(stored, upstream.replica.url)
        self.metrics.time_to_first_byte.labels(model).observe(time.monotonic() - started)
        out = web.StreamResponse(status=resp.status, headers=to_client(resp.headers))
        if resp.headers.get("Content-Encoding"):
            out.headers["Content-Encoding"] = resp.headers["Content-Encoding"]
        out.headers.update(extra)
        out.headers["x-argosy-backend"] = upstream.replica.url
        charged = self.tenants.meter(request, path, body, resp.status, resp.content_type)
        code = UNEXPECTED  # the code it counts under (relay.py); a gateway bug leaves this
        try:
            code = await relay(request, out, resp, upstream.replica.url,
                               first_chunk=upstream.first_chunk, feed=charged.feed,
                               idle_timeout_s=self.config.stream_idle_timeout_s,
                               remove_usage=self.tenants.usage_remover(
                                   request, resp.content_type))
        except asyncio.CancelledError:
            code = CLIENT_CLOSED  # the client went away (handler cancelled)
            raise
        finally:
            # Closing the upstream connection of an unfinished answer tells the replica to
            # abort the request and free its KV cache.
            upstream.release()
            charged.finish()  # what reached the client, also when the answer was cut short
            self.count(model, upstream.replica.url, code)
            if code == BROKEN:
                upstream.replica.mark_failure(self.config.health.unhealthy_after)
            elif code == str(resp.status):  # whole: its latency is "to the last byte"
                self.metrics.latency.labels(model).observe(time.monotonic() - started)
        return out


async def start_gateway(gateway: Gateway, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `gateway` on host:port (0 picks a free port); returns the runner and the port.
    `runner.cleanup()` stops accepting, then waits up to `drain_timeout_s` for the answers
    in flight before it cancels them (Gateway.start_drain)."""
    # aiohttp's shutdown timeout is only a fallback, a second after the gateway's own cut:
    # ending together, aiohttp's wait and the handler's end raised InvalidStateError in it.
    runner = web.AppRunner(gateway.make_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=gateway.config.drain_timeout_s + 1)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # the bound socket tells the real port when port=0
    bound = server.sockets[0].getsockname()[1] if server is not None else port
    return runner, int(bound)


async def run_gateway(config: GatewayConfig, config_file: ConfigFile | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then drain: refuse new connections, let the answers in
    flight finish (at most `drain_timeout_s`), close upstream connections cleanly.
    `config_file`: where `config` came from, re-read for its `tenants` and `routing` while
    serving."""
    import signal

    gateway = Gateway(config, config_file=config_file)
    runner, port = await start_gateway(gateway, config.host, config.port)
    logger.info("argosy gateway on http://%s:%d", config.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("stopping: no new connections; answers in flight may take up to %gs",
                    config.drain_timeout_s)
    finally:
        await runner.cleanup()
    logger.info("stopped")
