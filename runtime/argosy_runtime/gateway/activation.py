"""Scale from zero at the gateway: hold requests while a model has no replica, ask for one.

A model route with `activation` does not answer 503 when none of its replicas is healthy (the
deployment was scaled to zero, or every replica is restarting). Its requests wait here, and
while any waits the activator *signals* for a replica: a Kubernetes route merge-patches the
annotation `argosy.dev/activation-requested: <RFC3339 now>` onto its LLMDeployment, which the
operator's autoscaler answers by scaling 0 -> 1 (argosy_operator/autoscaling/activation.py);
`argosy fleet` reads `held` directly. The signal repeats every `refresh_s` while requests are
held, so a stamp the operator missed, or answered just before scaling to zero, is renewed.

Held requests go on, in arrival order, as soon as a replica is in rotation, or get 503 after
`timeout_s` (or at once when `argosy fleet` says the replica it started failed: `refuse`); a
client that disconnects while held simply stops waiting. When the signal learns that nothing
will answer it (a Kubernetes route whose LLMDeployment sits at `spec.replicas: 0` without
autoscaling), the held requests get that 503 at once, and so does every request for the next
`refresh_s`; after that the next request asks again. Holding costs nothing but an open
connection: the body is already read, and one watcher per model polls every 50 ms.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from argosy_runtime.background_tasks import cancel_and_wait
from argosy_runtime.gateway.backends.kube_api import KubeAPI, resolve
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.config import ActivationConfig, KubernetesBackendConfig

logger = logging.getLogger(__name__)

# = argosy_operator.constants.ANNOTATION_ACTIVATION (the gateway does not import the operator).
ACTIVATION_ANNOTATION = "argosy.dev/activation-requested"
POLL_S = 0.05

# Asks for a replica; returns None, or why no replica will come however long one waits.
Signal = Callable[[], Awaitable[str | None]]


class Activator:
    """Holds the requests of one model while none of its replicas is healthy."""

    def __init__(self, pool: ReplicaPool, config: ActivationConfig, signal: Signal | None = None
                 ) -> None:
        self.pool = pool
        self.config = config
        self.signal = signal
        # The held requests' futures, oldest first: one watcher resolves them in this order,
        # so they go on in arrival order (each polling on its own, a later arrival whose poll
        # came first went ahead).
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()
        self.unreachable: str | None = None  # the last signal's "no replica will come"
        self._signalled_at = float("-inf")
        self._signal_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def held(self) -> int:
        """Requests waiting right now (the demand `argosy fleet` scales from zero on)."""
        return len(self._waiters)

    def needed(self) -> bool:
        """No healthy replica: requests must wait. (Healthy replicas inside a Retry-After
        window are busy, not gone: those requests get the proxy's 429 instead.)"""
        return not any(r.healthy for r in self.pool.replicas)

    @property
    def full(self) -> bool:
        return self.held >= self.config.max_held

    async def wait(self) -> bool:
        """Hold until a replica is in rotation (True), or `timeout_s` passes or the signal says
        none will come (False; `unreachable` then says why)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(waiter)
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = loop.create_task(self._watch())
        try:
            return await asyncio.wait_for(waiter, self.config.timeout_s)
        except TimeoutError:
            return False
        finally:
            # Timed out, or the client went away (cancelled): no longer held, nor demand.
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def _watch(self) -> None:
        """While requests are held: signal every `refresh_s`, and release them all, oldest
        first, once a replica is in rotation or the signal says none will come."""
        while self._waiters:
            if not self.needed():
                self._release(True)
                return
            now = time.monotonic()
            if now - self._signalled_at >= self.config.refresh_s:
                self._signalled_at = now
                self._send_signal()  # forgets an older "no replica will come"
            if self.unreachable is not None:
                self._release(False)
                return
            await asyncio.sleep(POLL_S)

    def _release(self, ok: bool) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(ok)

    def refuse(self, reason: str) -> None:
        """Answer the held requests, and those of the next `refresh_s`, 503 `reason` now:
        the replica they wait for will not come (it failed to start, the fleet stops)."""
        self.unreachable = reason
        self._signalled_at = time.monotonic()
        self._release(False)

    def _send_signal(self) -> None:
        if self._signal_task is not None and not self._signal_task.done():
            return
        self.unreachable = None  # ask again: the deployment may have changed
        if self.signal is None:  # `argosy fleet`: its autoscaler reads `held`
            return
        logger.info("model %s: no replica; %d request(s) held, asking for one",
                    self.pool.model, self.held)
        # Not awaited by the request: a slow or failing API server must not stall it, and a
        # held client that disconnects must not cancel the signal the others rely on.
        self._signal_task = asyncio.get_running_loop().create_task(self._signal_quietly())

    async def _signal_quietly(self) -> None:
        assert self.signal is not None
        try:
            self.unreachable = await self.signal()
        except Exception as exc:  # logged; the next refresh tries again
            logger.warning("model %s: could not ask for a replica: %r", self.pool.model, exc)
            return
        if self.unreachable is not None:
            logger.warning("model %s: %s", self.pool.model, self.unreachable)

    async def close(self) -> None:
        await cancel_and_wait(self._watch_task)
        await cancel_and_wait(self._signal_task)


def kubernetes_signal(config: KubernetesBackendConfig, session: aiohttp.ClientSession) -> Signal:
    """Stamp `argosy.dev/activation-requested` on the route's LLMDeployment (merge patch).

    The patched object comes back: when it sits at `spec.replicas: 0` without autoscaling,
    no autoscaler will answer the stamp, and the signal says so. The gateway's service
    account needs `patch` on `llmdeployments.argosy.dev`.
    """
    path = (f"/apis/argosy.dev/v1alpha1/namespaces/{config.namespace}/llmdeployments/"
            f"{config.llmdeployment}")
    resolved: list[KubeAPI] = []  # resolved once (a kubeconfig's inline certs become files)

    async def signal() -> None:
        if not resolved:
            resolved.append(resolve(config.api_url))
        api = resolved[0]
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        patch = {"metadata": {"annotations": {ACTIVATION_ANNOTATION: stamp}}}
        headers = {**api.headers, "Content-Type": "application/merge-patch+json"}
        async with session.patch(api.base_url + path, data=json.dumps(patch), headers=headers,
                                 ssl=api.ssl_context,
                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"PATCH {path}: HTTP {resp.status}: {(await resp.text())[:300]}")
            llmd = await resp.json(content_type=None)
        return unreachable_reason(llmd, f"{config.namespace}/{config.llmdeployment}")

    return signal


def unreachable_reason(llmd: object, name: str) -> str | None:
    """Why no replica of this LLMDeployment will start however long one waits, or None."""
    spec = llmd.get("spec") if isinstance(llmd, dict) else None
    if not isinstance(spec, dict):
        return None
    autoscaled = (spec.get("autoscaling") or {}).get("enabled") is True
    if autoscaled or spec.get("replicas", 1) != 0:
        return None
    return (f"LLMDeployment {name} is at spec.replicas 0 without autoscaling, so nothing will "
            "start a replica; set spec.replicas, or enable autoscaling with minReplicas 0")
