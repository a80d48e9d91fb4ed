"""The tenants' gate in front of the proxy: an aiohttp middleware on `/v1/*` (the limits
and keys themselves are in gateway/tenants/).

For every `/v1/*` request it

1. finds the tenant whose key the `Authorization: Bearer` header carries (else a 401);
2. for a generation request (POST /v1/completions, /v1/chat/completions, /v1/responses)
   or an embeddings request (POST /v1/embeddings), admits it against the tenant's limits
   before any replica is picked (else a 429 with Retry-After) and holds its lease until the
   handler ends, however it ends (answered, failed, client gone): retries on other replicas
   happen inside the handler, so a retried request counts once. The Batch API, `/v1/models`
   and calls on stored responses only need the key;
3. hands the handler a copy of the request whose `Authorization` is the gateway's
   `replica_api_key` (or none): the tenant's key never reaches a replica, and every path that
   forwards client headers (headers.to_replica) forwards the replica key instead; and whose
   `X-Argosy-Owner` names the tenant, so that replicas keep each tenant's stored files,
   batches and responses to itself (server/owners.py).

A client never chooses an owner: the `X-Argosy-Owner` it sends is dropped on every request,
with tenants or without (then nobody owns what replicas store, as before tenants).

A tenant's `priority` becomes its generation and embeddings requests' scheduling priority
(`apply_priority`). The relay charges each answer's tokens through `meter()`, and every
answer to a tenant gets OpenAI's `x-ratelimit-*` headers as the limits stood when the request
arrived. Without tenants nothing is installed: clients' headers pass through as before, and
a `replica_api_key` is only sent on the gateway's own calls (`replica_headers`).

While the app runs, one watcher re-reads every few seconds the config file
(tenants/config_file.py, when the gateway was started from a file) and then the tenants'
`api_keys_file`s (tenants/key_files.py). Files are read on a worker thread; a new valid
config file is applied on the event loop in one step (`apply_reloaded`, no await inside): its
tenants here (`apply`), its routing through `apply_config` (the gateway's), so a request sees
either the old tenants and routing or the new ones, never a mix: keys, limiters, priorities
and policies are swapped together. A tenant that stays keeps its limiter (its buckets' usage
and its requests in flight) with the new limits applied to it; a removed tenant's requests
already admitted finish, their leases holding its old limiter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from argosy_runtime.background_tasks import running
from argosy_runtime.gateway.config import GatewayConfig, TenantConfig
from argosy_runtime.gateway.metrics import GatewayMetrics
from argosy_runtime.gateway.proxy.asked_usage import UsageEventRemover, ask_for_usage
from argosy_runtime.gateway.proxy.errors import error_response, invalid_api_key
from argosy_runtime.gateway.proxy.relay import CLIENT_CLOSED
from argosy_runtime.gateway.request_text import POOLING_PATHS, prompt_chars
from argosy_runtime.gateway.tenants.config_file import ConfigFile, ConfigRefused, Reloaded
from argosy_runtime.gateway.tenants.key_files import POLL_SECONDS, KeyFiles
from argosy_runtime.gateway.tenants.keys import KeyRing
from argosy_runtime.gateway.tenants.limiter import Clock, Lease, Refusal, TenantLimiter
from argosy_runtime.gateway.tenants.usage import UsageMeter
from argosy_runtime.server.owners import OWNER_HEADER

logger = logging.getLogger(__name__)

# Requests admitted against the limits, charged, and given a tenant's `priority` (the
# runtime's field): generation, and embeddings, scores, reranks and classifications, whose
# inputs cost a replica a prefill each. Token limits need no special case for them: admission never counts
# `max_tokens` (an answer's tokens are known only afterwards, limiter.py), and their answers'
# `usage` has prompt tokens only, so they are charged those and 0 completion tokens
# (tenants/usage.py).
ADMITTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                  *POOLING_PATHS)


def _request_key(name: str, kind: Any) -> Any:
    """A typed request storage key (web.RequestKey, aiohttp >= 3.14, which warns about plain
    string keys); a string on older aiohttp."""
    request_key = getattr(web, "RequestKey", None)
    return name if request_key is None else request_key(name, kind)


# Where the gate leaves its state on a request (copied along when the request is cloned).
_TENANT = _request_key("argosy_tenant", str)
_LEASE = _request_key("argosy_tenant_lease", Lease)
_HEADERS = _request_key("argosy_tenant_ratelimit_headers", dict)
_ASKED_USAGE = _request_key("argosy_tenant_asked_usage", bool)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ChargedAnswer:
    """Meters one relayed answer and charges its tokens to the request's tenant."""

    def __init__(self, tenant: str, lease: Lease, meter: UsageMeter,
                 metrics: GatewayMetrics) -> None:
        self.tenant = tenant
        self.lease = lease
        self.meter = meter
        self.metrics = metrics
        self._finished = False

    def feed(self, chunk: bytes) -> None:
        """A chunk that reached the client."""
        self.meter.feed(chunk)

    def finish(self) -> None:
        """The answer ended (completely or not): charge what it used, once."""
        if self._finished:
            return
        self._finished = True
        usage = self.meter.result()
        self.lease.charge(usage.total)
        self.metrics.tenant_tokens.labels(self.tenant, "prompt").inc(usage.prompt_tokens)
        self.metrics.tenant_tokens.labels(self.tenant, "completion").inc(
            usage.completion_tokens)


class _Uncharged:
    """The meter of a request no tenant pays for (no tenants configured)."""

    def feed(self, chunk: bytes) -> None:
        pass

    def finish(self) -> None:
        pass


UNCHARGED = _Uncharged()


class TenantGate:
    def __init__(self, tenants: Iterable[TenantConfig], metrics: GatewayMetrics,
                 replica_api_key: str | None = None, clock: Clock = time.monotonic,
                 keys_poll_s: float = POLL_SECONDS,
                 config_file: ConfigFile | None = None,
                 apply_config: Callable[[GatewayConfig], None] | None = None) -> None:
        """`config_file`: the file the gateway was started from, re-read while it runs (None:
        only the keys files are); `apply_config`: applies the rest of a reloaded file that
        may change live (the gateway's routing), called right after its tenants;
        `keys_poll_s`: how often the files are re-read."""
        tenants = tuple(tenants)
        self.tenants = tenants  # as configured now (the last applied reload)
        self.keys = KeyRing(tenants)
        self.key_files = KeyFiles(tenants, self.keys)
        self.config_file = config_file
        self.apply_config = apply_config
        self.keys_poll_s = keys_poll_s
        self.clock = clock
        self.limiters = {t.name: TenantLimiter(t, clock) for t in tenants}
        self.priorities = {t.name: t.priority for t in tenants if t.priority is not None}
        self.metrics = metrics
        self._replica_authorization = f"Bearer {replica_api_key}" if replica_api_key else None

    @property
    def replica_headers(self) -> dict[str, str]:
        """What the gateway's own calls to replicas carry (their --api-key, when set)."""
        if self._replica_authorization is None:
            return {}
        return {"Authorization": self._replica_authorization}

    def install(self, app: web.Application) -> None:
        """Put the gate in front of `app`'s handlers (without tenants, only the dropping of a
        client's owner header)."""
        app.middlewares.append(_drop_client_owner)
        if self.limiters:
            app.middlewares.append(self._middleware)
            app.on_response_prepare.append(_add_ratelimit_headers)
        if self.key_files.paths or self.config_file is not None:
            app.cleanup_ctx.append(self._watching)

    async def _watching(self, _: web.Application) -> AsyncIterator[None]:
        """While the app runs, re-read the files every `keys_poll_s`."""
        async with running(self.watch(), name="tenant files watcher"):
            yield

    async def watch(self) -> None:
        """`reload` every `keys_poll_s` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.keys_poll_s)
            try:
                await self.reload()
            except Exception:
                # A bug in applying one round (reload guards what it expects) must not end
                # the watching: keys removed from their files would go on working.
                logger.exception("tenants: a reload round failed; watching goes on")
                self.metrics.config_reload_failures.inc()

    async def reload(self) -> None:
        """One round: the config file first (a new tenants section brings its own keys
        files), then the keys files. Never raises: one bad round must not stop the
        watching."""
        if self.config_file is not None:
            try:
                reloaded = await asyncio.to_thread(self.config_file.reread_config)
            except ConfigRefused as exc:
                logger.error("%s; the gateway keeps serving its previous tenants (%s) and "
                             "routing", exc, ", ".join(t.name for t in self.tenants) or "none")
                self.metrics.config_reload_failures.inc()
            except Exception:
                logger.exception("%s: reload failed", self.config_file.path)
                self.metrics.config_reload_failures.inc()
            else:
                if reloaded is not None:
                    self.apply_reloaded(reloaded)
            self.metrics.config_refused.set(1 if self.config_file.refused else 0)
        try:
            await asyncio.to_thread(self.key_files.sync)
        except Exception:
            logger.exception("tenants' api_keys_file: reload failed")

    def apply_reloaded(self, reloaded: Reloaded) -> None:
        """Serve a reloaded, validated config file from the next request on: its tenants
        (when they may apply) and, through `apply_config`, its routing. No await inside: a
        request sees all of it or none."""
        if reloaded.tenants is not None:
            self.apply(reloaded.tenants)
        if self.apply_config is not None:
            self.apply_config(reloaded.config)

    def apply(self, tenants: tuple[TenantConfig, ...]) -> None:
        """Serve `tenants` (a reloaded, validated config) from the next request on. Runs on
        the event loop without awaiting, so no request sees half of it."""
        before = {t.name: t for t in self.tenants}
        after = {t.name: t for t in tenants}
        added = [name for name in after if name not in before]
        removed = [name for name in before if name not in after]
        changed = [name for name in after
                   if name in before and after[name] != before[name]]
        if not (added or removed or changed):
            return  # only formatting, comments or the order moved
        limiters = {}
        for tenant in tenants:
            limiter = self.limiters.get(tenant.name)
            if limiter is None:
                limiter = TenantLimiter(tenant, self.clock)
            else:
                limiter.set_limits(tenant)
            limiters[tenant.name] = limiter
        self.key_files = KeyFiles(tenants, self.keys)
        self.keys.set_digests(self.key_files.digests)
        self.limiters = limiters
        self.priorities = {t.name: t.priority for t in tenants if t.priority is not None}
        self.tenants = tenants
        where = self.config_file.path if self.config_file is not None else "config"
        logger.info("%s: tenants reloaded (added: %s; removed: %s; changed: %s)", where,
                    ", ".join(added) or "none", ", ".join(removed) or "none",
                    ", ".join(changed) or "none")

    def apply_priority(self, request: web.Request, body: dict[str, Any]) -> bool:
        """Give a generation or embeddings request its tenant's scheduling priority: the tenant's value when
        the body has none or a more urgent (lower) one, else the body's. True when `body`
        changed. A non-integer `priority` is left for the replica to refuse (400)."""
        floor = self.priorities.get(request.get(_TENANT, ""))
        if floor is None or request.path not in ADMITTED_PATHS:
            return False
        sent = body.get("priority")
        if sent is not None and (isinstance(sent, bool) or not isinstance(sent, int)
                                 or sent >= floor):
            return False
        body["priority"] = floor
        return True

    def ask_for_usage(self, request: web.Request, body: dict[str, Any]) -> bool:
        """Ask for the usage of a metered stream the client did not ask it for (asked_usage.py);
        True when `body` changed."""
        if request.get(_LEASE) is None or not ask_for_usage(request.path, body):
            return False
        request[_ASKED_USAGE] = True
        return True

    @staticmethod
    def usage_remover(request: web.Request, content_type: str) -> UsageEventRemover | None:
        """What takes the usage event `ask_for_usage` asked for out of the client's stream
        (an answer of another type, such as a JSON error, passes as it is)."""
        if request.get(_ASKED_USAGE) and content_type == "text/event-stream":
            return UsageEventRemover()
        return None

    def meter(self, request: web.Request, path: str, body: dict, status: int,
              content_type: str) -> ChargedAnswer | _Uncharged:
        """The meter of an answer about to be relayed for `request` (whose parsed body is
        `body`); `feed` it each chunk that reached the client, `finish` it at the end."""
        lease = request.get(_LEASE)
        if lease is None:
            return UNCHARGED
        meter = UsageMeter(prompt_chars(path, body), status=status,
                           streamed=content_type == "text/event-stream")
        return ChargedAnswer(request[_TENANT], lease, meter, self.metrics)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # /health, /ready, /metrics stay open; vLLM's /score, /rerank, /classify and Cohere's
        # /v2/rerank are outside /v1/ but answered by the replicas, so they need a key too.
        if not (request.path.startswith("/v1/") or request.path in ADMITTED_PATHS):
            return await handler(request)
        tenant = self.keys.tenant_of(request.headers.get("Authorization"))
        if tenant is None:
            return invalid_api_key()
        limiter = self.limiters[tenant]
        lease: Lease | None = None
        if request.method == "POST" and request.path in ADMITTED_PATHS:
            admitted = limiter.admit()
            if isinstance(admitted, Refusal):
                self.metrics.tenant_rate_limited.labels(tenant, admitted.limit).inc()
                self.metrics.tenant_requests.labels(tenant, "429").inc()
                return error_response(
                    429, admitted.message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(admitted.retry_after_s), **limiter.headers()},
                )
            lease = admitted
        # Set before the request is cloned: aiohttp prepares a returned response with the
        # original request, a streamed one with the clone; both must find the headers.
        request[_TENANT] = tenant
        request[_LEASE] = lease
        request[_HEADERS] = limiter.headers()
        code = "500"
        try:
            response = await handler(self._for_replicas(request, tenant))
            code = str(response.status)
            return response
        except web.HTTPException as exc:
            code = str(exc.status)
            raise
        except asyncio.CancelledError:
            code = CLIENT_CLOSED
            raise
        finally:
            if lease is not None:
                lease.release()
            self.metrics.tenant_requests.labels(tenant, code).inc()

    def _for_replicas(self, request: web.Request, tenant: str) -> web.Request:
        """The request with the tenant's key replaced by the replica key (or removed), naming
        the tenant as the owner of what it stores and reads."""
        headers = CIMultiDict(request.headers)
        headers.popall("Authorization", None)
        if self._replica_authorization is not None:
            headers["Authorization"] = self._replica_authorization
        headers[OWNER_HEADER] = tenant
        return request.clone(headers=headers)


@web.middleware
async def _drop_client_owner(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Drop an owner header a client sent: only the gate names owners."""
    if OWNER_HEADER in request.headers:
        headers = CIMultiDict(request.headers)
        headers.popall(OWNER_HEADER)
        request = request.clone(headers=headers)
    return await handler(request)


async def _add_ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(request.get(_HEADERS, {}))
