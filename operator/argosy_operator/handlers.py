"""The kopf layer: registrations only; the work is in `reconcile` and `status`.

Run with `kopf run -A --standalone -m argosy_operator.handlers` (or `argosy operator`).

- create/update/resume of an LLMDeployment -> `reconcile` (children) + `refresh_status`;
- events of the Deployments and pods the operator manages -> `refresh_status` of their owner,
  so conditions follow the pods (image pull failures, unschedulable GPU requests, readiness);
- a child deleted by someone else (a Deployment, Service, PodDisruptionBudget, LoRA ConfigMap
  or ServiceMonitor) -> `reconcile` of its owner, which re-creates it if the spec still wants it;
- a child edited by someone else on a field the operator manages (`drift`, decided from the
  event's object alone) -> `reconcile` of its owner, which puts the operator's fields back;
- the ServiceMonitor CRD established while the operator runs (clusterwide only) -> `reconcile`
  of every LLMDeployment that asks for a ServiceMonitor;
- namespaced (`-n`), a timer on each LLMDeployment that asks for a ServiceMonitor: once the
  CRD is served and the ServiceMonitor is missing -> `reconcile` of that LLMDeployment.

There are no deletion handlers: every child carries an owner reference, and Kubernetes'
garbage collector deletes the children with their LLMDeployment. kopf's own finalizer is on an
LLMDeployment only while one of the timers runs for it (autoscaling; namespaced, the
ServiceMonitor recheck), until that timer has stopped (docs/operator.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from argosy_operator import drift
from argosy_operator.conditions import condition, find_condition, now_rfc3339
from argosy_operator.constants import (
    COND_DEGRADED,
    GROUP,
    LABEL_LLMD,
    LABEL_MANAGED_BY,
    OPERATOR_NAME,
    PLURAL,
    VERSION,
)
from argosy_operator.kube import (
    API_ERRORS,
    CONFIGMAPS,
    LLMDEPLOYMENTS,
    PDBS,
    SERVICEMONITORS,
    SERVICES,
    ApiError,
    KubeClient,
    Resource,
)
from argosy_operator.reconcile import ChildConflictError, reconcile
from argosy_operator.spec import DEFAULTS, InvalidSpecError
from argosy_operator.status import (
    patch_status,
    refresh_status,
    refusal_superseded,
    status_patch,
)

KOPF_PREFIX = "kopf.argosy.dev"
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={OPERATOR_NAME},{LABEL_LLMD}"

_state: dict[str, Any] = {"info": None, "client": None, "clusterwide": True}


def get_client() -> KubeClient:
    """The operator's API client (built from the credentials of kopf's last login)."""
    client = _state["client"]
    if client is None:
        if _state["info"] is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
        client = _state["client"] = KubeClient.from_connection_info(_state["info"])
    return client


class GenerationProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's progress annotations, forgotten once the spec changes (a new generation).

    A reconcile that failed (an API error, a ChildConflict) waits for its retry, up to
    APPLY_RETRY_DELAYS[-1]; kopf keeps that wait, and the count of tries behind it, across
    later changes of the object. So a spec that fixes the failure (dropping the child whose
    name is taken, say) was applied only when the wait of the old generation ran out,
    minutes later. Each record notes the generation it was written for; a record of another
    generation is not handed to kopf, which then reconciles the new spec at once, counting
    tries from zero."""

    _GENERATION = "generation"

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        record = super().fetch(key=key, body=body)
        if record is None:
            return None
        record = dict(record)
        generation = record.pop(self._GENERATION, None)
        if generation is not None and generation != body.get("metadata", {}).get("generation"):
            return None
        # Without the note: kopf stores a record again only when it differs from the fetched.
        return record

    def store(self, *, key: Any, record: Any, body: kopf.Body, patch: Any) -> None:
        generation = body.get("metadata", {}).get("generation")
        if generation is not None:
            record = {**record, self._GENERATION: generation}
        super().store(key=key, record=record, body=body, patch=patch)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # One operator replica (the Deployment uses the Recreate strategy): no peering objects.
    settings.peering.standalone = True
    # Scanning, when clusterwide (`-A`, the in-cluster Deployment): kopf watches CRDs, so a
    # CRD installed later (the ServiceMonitor's) is watched without a restart; clusterwide,
    # kopf never lists namespaces. With `-n NS` scanning would list and watch namespaces
    # (no RBAC for that), so it stays off and kopf serves the exact names given. kopf sets
    # settings.peering.clusterwide from the command line before the startup handlers run.
    settings.scanning.disabled = not settings.peering.clusterwide
    _state["clusterwide"] = settings.peering.clusterwide  # read by `_recheck_servicemonitor`
    if settings.peering.clusterwide:
        # Registered here rather than by a decorator: with `-n` kopf would list and watch
        # CRDs for this handler too (not granted there). kopf reads its handlers and starts
        # its watches only after the startup handlers; a repeated registration (several runs
        # in one process, as in the tests) is deduplicated by the handler's id.
        _established_crds.clear()
        kopf.on.event(CRDS.group, CRDS.version, CRDS.plural, id="servicemonitor_crd",
                      field="metadata.name", value=SERVICEMONITOR_CRD)(servicemonitor_crd_changed)
    # Events only for what the operator did (posted explicitly), not for every log line.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = OPERATOR_NAME
    settings.posting.reporting_instance = os.environ.get("POD_NAME", OPERATOR_NAME)
    # Keep kopf's bookkeeping out of status (which users and the autoscaler read).
    settings.persistence.progress_storage = GenerationProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration")
    # Watch only the operator's own children and pods, filtered by the API server (the
    # handlers' label filters alone would stream every pod, Service and ConfigMap of the
    # cluster to the operator).
    for key in (("apps", "deployments"), ("v1", "pods"), *_WATCHED_CHILDREN):
        settings.watching.label_selectors[key] = CHILD_SELECTOR
    settings.watching.server_timeout = int(os.environ.get("ARGOSY_WATCH_TIMEOUT", "300"))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    # A deleted LLMDeployment keeps kopf's finalizer until its autoscaling timer has stopped;
    # a tick in flight (a scrape takes up to 2 s) is waited for, and kopf looks again only
    # after this polling (60 s by default), so the deletion hung a minute.
    settings.background.cancellation_polling = 1.0


def connection_info(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The operator's credentials: the in-cluster service account first, else the kubeconfig
    (`argosy operator` tries this once before kopf starts, to refuse a setup without any)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """`connection_info`; also rebuilds our client (kopf logs in again when a token expires,
    e.g. a rotated service-account token)."""
    info = connection_info(**kwargs)
    if info is not None and info != _state["info"]:
        _state["info"] = info
        old, _state["client"] = _state["client"], None  # rebuilt lazily from the new info
        if old is not None:
            await old.close()
    return info


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    client = _state["client"]
    _state["client"] = None
    if client is not None:
        await client.close()


def _post_degraded_event(body: Any, patch: dict[str, Any] | None, base: Mapping[str, Any], *,
                         on_new_message: bool = False) -> None:
    """A Warning event when the Degraded condition turns True or changes its reason (not on
    every status write while it stays degraded for the same reason); with `on_new_message`
    also when its message or generation changes (another refused spec). `base` is the object
    the patch was computed against: comparing with a stale body would announce a reason that
    a concurrent handler already wrote (and announced)."""
    cond = find_condition((patch or {}).get("conditions"), COND_DEGRADED)
    if cond is None or cond.get("status") != "True":
        return
    before = find_condition((base.get("status") or {}).get("conditions"), COND_DEGRADED) or {}
    announced = before == cond if on_new_message else (
        before.get("status") == "True" and before.get("reason") == cond.get("reason"))
    if announced:
        return
    kopf.event(body, type="Warning", reason=str(cond.get("reason")),
               message=str(cond.get("message")))


async def _report_degraded(client: KubeClient, llmd: dict[str, Any], reason: str,
                           message: str, generation: int | None) -> None:
    """Degraded=True with `reason` (and a Warning event the first time it is set)."""
    cond = condition(COND_DEGRADED, True, reason, message, generation)
    patch, base = await patch_status(client, llmd, lambda cur: status_patch(
        cur, {"conditions": [cond]}, now_rfc3339()))
    if patch is not None:
        kopf.event(llmd, type="Warning", reason=reason, message=message)
    if refusal_superseded(base):
        # This generation replaced a refused spec: the refusal's Ready, Progressing and
        # Stalled give way to what the children say (a retried failure is in progress, not
        # failed for good). Read again: the refresh must see the Degraded just written, the
        # sign that a reconcile of this generation has reported.
        fresh = await _live_owner(client, llmd["metadata"].get("namespace"),
                                  llmd["metadata"].get("name"))
        if fresh is not None:
            await refresh_status(client, fresh)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_llmdeployment(body: kopf.Body, meta: kopf.Meta, logger: logging.Logger,
                                  retry: int = 0, **_: Any) -> None:
    """Apply the children, then the status (observedGeneration = this generation)."""
    client = get_client()
    llmd = dict(body)
    generation = meta.get("generation")
    try:
        async with _reconcile_lock(meta.get("namespace"), meta.get("name")):
            if not await _still_exists(client, meta):
                # kopf may hand over an event queued before the user's delete: applying that
                # stale body would re-create the children of an object that no longer exists.
                logger.info("deleted meanwhile; nothing to reconcile")
                return
            result = await reconcile(client, llmd)
    except InvalidSpecError as exc:
        # A spec the children cannot be built from: a stale CRD let it through, or the CRD
        # cannot express the rule (the name, label values, ...). Retrying would not help.
        # Only this error: any other (a ValueError from a bad API answer, say) is retried.
        # Nothing was written: the children of the last applied spec keep running. This
        # generation was looked at (observedGeneration) and failed for good (Stalled).
        await _write_status(client, llmd, generation, retry, invalid_spec=str(exc))
        raise kopf.PermanentError(str(exc)) from exc
    except ChildConflictError as exc:
        # A child still being deleted (an LLMDeployment deleted and applied again, as GitOps
        # tools replace one) is gone in seconds: retry soon. Someone else's object stays
        # until a person acts: back off as for API errors (a fixed 30 s was both too slow
        # for the first and too frequent for the second).
        delay = reapply_retry_delay(retry) if exc.being_deleted else apply_retry_delay(retry)
        try:
            await _report_degraded(client, llmd, "ChildConflict", str(exc), generation)
        except API_ERRORS as status_exc:
            # Retried like the conflict itself (not a raw exception with kopf's backoff).
            raise kopf.TemporaryError(
                f"{exc}; reporting it failed: {_describe(status_exc)}", delay=delay) from exc
        raise kopf.TemporaryError(str(exc), delay=delay) from exc
    except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
        # A child refused (403 RBAC, 422 invalid, 5xx) or the API server unreachable: say so
        # on the owner, and let kopf retry later and later (a 403 or 422 stays until someone
        # acts; a fixed short delay would hammer the API server for as long).
        await _report_apply_failed(client, llmd, exc, generation, first_try=retry == 0)
        raise kopf.TemporaryError(str(exc), delay=apply_retry_delay(retry)) from exc
    for action in result.actions:
        logger.info(action)
        # kopf.event, not kopf.info: the latter obeys posting.level (WARNING, see configure).
        kopf.event(body, type="Normal", reason=action.split(" ", 1)[0].capitalize(),
                   message=action)
    await _write_status(client, llmd, generation, retry)


async def _write_status(client: KubeClient, llmd: dict[str, Any], generation: int | None,
                        retry: int, *, invalid_spec: str | None = None) -> None:
    """The status of a reconciled (or refused) generation, with its Warning event. Should the
    API server fail the write, kopf retries the reconcile (a no-op for the children) later:
    observedGeneration is written only here."""
    try:
        patch, base = await refresh_status(client, llmd, observed_generation=generation,
                                           invalid_spec=invalid_spec)
    except API_ERRORS as exc:
        raise kopf.TemporaryError(f"writing the status failed: {_describe(exc)}",
                                  delay=apply_retry_delay(retry)) from exc
    _post_degraded_event(llmd, patch, base, on_new_message=invalid_spec is not None)


def _describe(exc: BaseException) -> str:
    """An API error for one log line (a TimeoutError's str is empty)."""
    return str(exc) or type(exc).__name__


_log = logging.getLogger("argosy.operator")

# Seconds kopf waits before retrying a create/update/resume reconcile that failed on the API
# (`retry` is kopf's count of earlier tries); the last one repeats.
APPLY_RETRY_DELAYS: tuple[float, ...] = (10.0, 20.0, 40.0, 80.0, 160.0, 300.0)


def apply_retry_delay(retry: int) -> float:
    return APPLY_RETRY_DELAYS[min(retry, len(APPLY_RETRY_DELAYS) - 1)]


async def _report_apply_failed(client: KubeClient, llmd: dict[str, Any], exc: Exception,
                               generation: int | None, *, first_try: bool) -> None:
    """Degraded=True ApplyFailed quoting the API server's answer (a Warning event when that
    condition changes). While the API server fails the status write too, a Warning event at
    the first failure is all that can be said."""
    try:
        await _report_degraded(client, llmd, "ApplyFailed", str(exc), generation)
    except (ApiError, aiohttp.ClientError, TimeoutError) as status_exc:
        _log.warning("could not report the failure on %s/%s: %s",
                     llmd["metadata"].get("namespace"), llmd["metadata"].get("name"),
                     status_exc)
        if first_try:
            kopf.event(llmd, type="Warning", reason="ApplyFailed", message=str(exc))


# One reconcile at a time per LLMDeployment. A reapply (a child deleted) reads the owner, then
# writes; without the lock a spec change that drops a child (the PDB, say) could be applied in
# between, and the reapply's older spec would bring the dropped child back for good. Weak
# values: a lock lives only while a reconcile holds or awaits it.
_reconcile_locks: weakref.WeakValueDictionary[tuple[str | None, str | None], asyncio.Lock] = (
    weakref.WeakValueDictionary())


def _reconcile_lock(namespace: str | None, name: str | None) -> asyncio.Lock:
    lock = _reconcile_locks.get((namespace, name))
    if lock is None:
        lock = _reconcile_locks[(namespace, name)] = asyncio.Lock()
    return lock


async def _live_owner(client: KubeClient, namespace: str | None, name: str | None
                      ) -> dict[str, Any] | None:
    """The LLMDeployment as it is now; None when it is gone or being deleted (its children go
    with it)."""
    llmd = await client.get(LLMDEPLOYMENTS, namespace, name)
    if llmd is None or (llmd.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return llmd


async def _still_exists(client: KubeClient, meta: Mapping[str, Any]) -> bool:
    """Whether this very object (same uid) is still there and not being deleted."""
    live = await _live_owner(client, meta.get("namespace"), meta.get("name"))
    return live is not None and (live.get("metadata") or {}).get("uid") == meta.get("uid")


# Seconds between the attempts of a reapply (or of a status-only refresh) that failed; the
# last one repeats until it succeeds or the owner is gone. kopf retries create/update/resume
# handlers (TemporaryError) but never event handlers, so the reapply retries itself. It waits
# in the worker kopf runs for the deleted child, which gets no other event (a re-created child
# has another uid), or for the edited one, whose later events kopf holds meanwhile and then
# hands over as one (the latest: the owner's status catches up then; only API errors fail a
# revert, and while the API server fails, status writes would fail too); kopf cancels it at
# shutdown, and the resume reconcile after a restart covers it.
REAPPLY_RETRY_DELAYS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)


def reapply_retry_delay(attempt: int) -> float:
    """Seconds to wait after failed try number `attempt` (0-based) of a reapply."""
    return REAPPLY_RETRY_DELAYS[min(attempt, len(REAPPLY_RETRY_DELAYS) - 1)]


async def _reapply(client: KubeClient, namespace: str, owner: str,
                   reason: str | None = None) -> None:
    """Reconcile the owner's current spec after one of its children was deleted or edited
    (drift, `reason` says which, for the log), retrying with backoff until it succeeds or the
    owner is gone; then refresh its status."""
    attempt = 0
    while not await _try_reapply(client, namespace, owner, first_try=attempt == 0,
                                 reason=reason):
        await asyncio.sleep(reapply_retry_delay(attempt))
        attempt += 1


# uid -> the refused generation whose "not reapplying" warning `_try_reapply` logged.
_refusal_logged: dict[str | None, int | None] = {}


async def _try_reapply(client: KubeClient, namespace: str, owner: str, *,
                       first_try: bool, reason: str | None = None) -> bool:
    """One try of `_reapply`: True when done (reconciled, or the owner is gone); False when
    it failed in a way a later try may get past (an API error, an unreachable API server, a
    foreign object in a child's place). `reason` (what happened to the child) is logged once
    the reconcile restored something."""
    # Read the spec under the lock: a reconcile of a newer spec finishes first.
    async with _reconcile_lock(namespace, owner):
        llmd: dict[str, Any] | None = None
        try:
            llmd = await _live_owner(client, namespace, owner)
            if llmd is None:
                return True
            generation = (llmd.get("metadata") or {}).get("generation")
            try:
                result = await reconcile(client, llmd)
            except ChildConflictError as exc:
                # Someone put their own object where the deleted child was: say so on the
                # owner, as a create or update would (a Warning event when it changes).
                await _report_degraded(client, llmd, "ChildConflict", str(exc), generation)
                return False
            except InvalidSpecError as exc:
                # The update handler reported it (InvalidSpec); no retry helps until the spec
                # changes, and that change reconciles (re-creating the child) anyway. Once per
                # refused generation: every later event of a drifted child comes here again.
                uid = (llmd.get("metadata") or {}).get("uid")
                if _refusal_logged.get(uid) != generation:
                    _refusal_logged[uid] = generation
                    _log.warning("not reapplying the children of %s/%s: its spec is refused "
                                 "(%s); a missing or changed child is restored once the spec "
                                 "is fixed", namespace, owner, exc)
                # A status-only refresh, as for any child event: the replica counts follow
                # the children of the last applied spec, the refusal's conditions stay.
                return await _try_refresh(client, namespace, owner, llmd)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            if llmd is not None:
                await _report_apply_failed(client, llmd, exc,
                                           (llmd.get("metadata") or {}).get("generation"),
                                           first_try=first_try)
            _log.warning("reapplying the children of %s/%s failed (retrying): %s",
                         namespace, owner, exc)
            return False
        if reason and result.actions:
            # Logged here, not when the event came: a child that cannot be restored (the
            # spec refused) would log a line per event of it, each saying it was reverted.
            _log.info("%s: restored from LLMDeployment %s/%s", reason, namespace, owner)
        for action in result.actions:
            kopf.event(llmd, type="Normal", reason=action.split(" ", 1)[0].capitalize(),
                       message=action)
        # A full reconcile of this generation: it clears a ChildConflict reported by an
        # earlier try (a status-only refresh keeps reconcile failures). Under the lock, so
        # that this generation's status never lands after a newer one's reconcile.
        patch, base = await refresh_status(client, llmd, observed_generation=generation)
        _post_degraded_event(llmd, patch, base)
        return True


async def _refresh_owner(namespace: str | None, owner: str | None, *,
                         reapply: bool = False, reason: str | None = None) -> None:
    """Recompute the owner's status; with `reapply`, reconcile its children first (`reason`:
    what happened to the child, for the log)."""
    if not namespace or not owner:
        return
    client = get_client()
    if reapply:
        await _reapply(client, namespace, owner, reason)
        return
    # Retried like a reapply (kopf never retries an event handler): without a later event of
    # this child, a failed refresh would leave the status stale.
    attempt = 0
    while not await _try_refresh(client, namespace, owner):
        await asyncio.sleep(reapply_retry_delay(attempt))
        attempt += 1


async def _try_refresh(client: KubeClient, namespace: str, owner: str,
                       llmd: dict[str, Any] | None = None) -> bool:
    """One try of a status-only refresh of the owner (`llmd`, or read now): True when done (or
    the owner is gone); False, after one log line, when the API server failed it (a conflict
    that outlasted patch_status's retries, a 5xx, no answer in time)."""
    try:
        if llmd is None:
            llmd = await _live_owner(client, namespace, owner)
            if llmd is None:
                return True
        patch, base = await refresh_status(client, llmd)
    except API_ERRORS as exc:
        _log.warning("refreshing the status of %s/%s failed (retrying): %s",
                     namespace, owner, _describe(exc))
        return False
    _post_degraded_event(llmd, patch, base)
    return True


_CHILD_LABELS = {LABEL_MANAGED_BY: OPERATOR_NAME, LABEL_LLMD: kopf.PRESENT}


async def _reapply_reason(event: kopf.RawEvent, body: Mapping[str, Any],
                         namespace: str | None, owner: str | None) -> str | None:
    """Why a child's watch event calls for reapplying its owner, as a line for the log (None:
    it does not): the child was deleted, or edited on a field the operator manages. The
    operator's own writes and status updates are no drift (see `drift`): deciding that reads
    only the event's object, no API request."""
    meta = body.get("metadata") or {}
    child = f"{body.get('kind', 'child')} {namespace}/{meta.get('name')}"
    if event.get("type") == "DELETED":
        drift.forget(body)
        return f"{child} was deleted"
    if not namespace or not owner:
        return None
    field = drift.drifted(body)
    if field is not None:
        # A reconcile of the owner in flight may have written this very object and not noted
        # it yet (the watch can deliver a write before its response arrives): look again once
        # it is done, rather than reapply for nothing.
        async with _reconcile_lock(namespace, owner):
            field = drift.drifted(body)
    if field is None:
        return None
    return f"{child} was changed outside the operator ({field} differs from what it applied)"


@kopf.on.event("apps", "v1", "deployments", labels=_CHILD_LABELS)
async def deployment_changed(event: kopf.RawEvent, body: kopf.Body, meta: kopf.Meta,
                             namespace: str | None, **_: Any) -> None:
    """Rollout progress and replica counts flow into the owner's status; a Deployment deleted
    or edited by hand (its owner still there) is re-created or reverted at once."""
    owner = meta.get("labels", {}).get(LABEL_LLMD)
    reason = await _reapply_reason(event, dict(body), namespace, owner)
    await _refresh_owner(namespace, owner, reapply=reason is not None, reason=reason)


# The other children, watched for deletion and drift. Without the ServiceMonitor CRD kopf logs
# one warning and watches the rest; a CRD installed later starts its watch when the operator
# runs clusterwide (CRD scanning, see `configure`), else at the next operator restart
# (meanwhile `servicemonitor_recheck` re-creates a missing ServiceMonitor).
_WATCHED_CHILDREN = tuple((res.group or res.version, res.plural)
                          for res in (SERVICES, PDBS, CONFIGMAPS, SERVICEMONITORS))


@kopf.on.event(SERVICES.group, SERVICES.version, SERVICES.plural, labels=_CHILD_LABELS)
@kopf.on.event(PDBS.group, PDBS.version, PDBS.plural, labels=_CHILD_LABELS)
@kopf.on.event(CONFIGMAPS.group, CONFIGMAPS.version, CONFIGMAPS.plural, labels=_CHILD_LABELS)
@kopf.on.event(SERVICEMONITORS.group, SERVICEMONITORS.version, SERVICEMONITORS.plural,
               labels=_CHILD_LABELS)
async def child_changed(event: kopf.RawEvent, body: kopf.Body, meta: kopf.Meta,
                        namespace: str | None, **_: Any) -> None:
    """A child deleted by hand (or pruned by a GitOps tool) while its owner stays is re-created
    at once, from the owner's current spec: a child the operator deleted itself because the
    spec no longer asks for it stays deleted. A child edited by hand on a field the operator
    manages is reverted at once, the same way. Other events of these kinds change nothing the
    status reads, so they cost no request."""
    owner = meta.get("labels", {}).get(LABEL_LLMD)
    reason = await _reapply_reason(event, dict(body), namespace, owner)
    if reason is not None:
        await _refresh_owner(namespace, owner, reapply=True, reason=reason)


CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)
SERVICEMONITOR_CRD = f"{SERVICEMONITORS.plural}.{SERVICEMONITORS.group}"
# uids of ServiceMonitor CRDs seen established in this run (one per install of the CRD).
_established_crds: set[str] = set()


def _established(crd: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


def _wants_servicemonitor(llmd: Mapping[str, Any]) -> bool:
    monitoring = (llmd.get("spec") or {}).get("monitoring") or {}
    return bool(monitoring.get("serviceMonitor", DEFAULTS["monitoring"]["serviceMonitor"]))


async def servicemonitor_crd_changed(event: kopf.RawEvent, body: kopf.Body, meta: kopf.Meta,
                                     **_: Any) -> None:
    """The ServiceMonitor CRD established while the operator runs (the Prometheus Operator
    installed after Argosy; clusterwide only, registered in `configure`): reconcile every
    LLMDeployment that asks for a ServiceMonitor, so each gets one now rather than at its next
    spec change. Once per install of the CRD (its uid): later edits of the CRD change nothing.
    The CRD found at startup (kopf's initial listing, no event type) is marked seen without a
    reconcile: the resume reconciles of the startup already create the ServiceMonitors."""
    if not _state["clusterwide"]:
        return  # a registration left from a clusterwide run in this process (tests)
    client = get_client()
    # The CRD changed (deleted, say): reconciles must not go on with a cached discovery answer.
    client.forget_discovery(SERVICEMONITORS)
    uid = meta.get("uid") or ""
    if event.get("type") == "DELETED":
        _established_crds.discard(uid)
        return
    if uid in _established_crds or not _established(body):
        return  # created but not yet served: its status update comes as another event
    _established_crds.add(uid)
    if event.get("type") is None:
        return
    # The API server lists a CRD in discovery (what reconcile checks) just after it marks it
    # Established: wait for that, briefly. Fresh answers, which the reconciles below then use.
    # A failed discovery request (a proxy's 503) is no answer either: ask again. Raising would
    # lose these reconciles (the CRD's uid is already marked seen).
    for attempt in range(len(REAPPLY_RETRY_DELAYS)):
        try:
            if await client.has_resource(SERVICEMONITORS, fresh=True):
                break
        except API_ERRORS as exc:
            _log.warning("asking API discovery for the ServiceMonitor API failed: %s",
                         _describe(exc))
        await asyncio.sleep(reapply_retry_delay(attempt))
    # Retried until it succeeds, for the same reason (kopf never retries an event handler,
    # and no later event of this CRD reconciles: its uid is marked seen); kopf cancels the
    # wait at shutdown, and the resume reconciles after a restart cover it.
    attempt = 0
    while True:
        try:
            listed = await client.list(LLMDEPLOYMENTS, None)
            break
        except API_ERRORS as exc:
            _log.warning("listing the LLMDeployments to reconcile for the ServiceMonitor CRD "
                         "failed (retrying): %s", _describe(exc))
        await asyncio.sleep(reapply_retry_delay(attempt))
        attempt += 1
    owners = [(o["metadata"]["namespace"], o["metadata"]["name"])
              for o in listed if _wants_servicemonitor(o)]
    _log.info("the ServiceMonitor CRD is established: reconciling %d LLMDeployments",
              len(owners))
    # Concurrently: one owner whose reapply keeps failing (a foreign ServiceMonitor in the
    # way) must not hold up the others.
    await asyncio.gather(*(_refresh_owner(ns, name, reapply=True) for ns, name in owners))


# Seconds between two checks of the namespaced timer below (and before the first: the resume
# reconcile at startup covers a CRD already there).
SERVICEMONITOR_RECHECK_SECONDS = float(os.environ.get("ARGOSY_SERVICEMONITOR_RECHECK_SECONDS",
                                                      "120"))


def _recheck_servicemonitor(body: kopf.Body, **_: Any) -> bool:
    """kopf `when` filter of the timer below: namespaced runs only (clusterwide, the CRD
    watch does this job), LLMDeployments that ask for a ServiceMonitor only."""
    return not _state["clusterwide"] and _wants_servicemonitor(body)


# Namespaced (`-n`) the operator may not list or watch CRDs (cluster-scoped objects: the
# shipped ClusterRole grants that for its clusterwide Deployment, and an install restricted to
# namespaces may well lack it), so it does not watch for the ServiceMonitor CRD as
# `servicemonitor_crd_changed` does clusterwide. A timer per
# LLMDeployment that wants a ServiceMonitor asks API discovery instead (readable by every
# user): while the CRD is absent that one request is all a tick costs; once it is served, a
# GET of the ServiceMonitor, and a reconcile only when it is missing (the CRD installed after
# the operator started, or, with no ServiceMonitor watch until a restart, one deleted by hand).
@kopf.timer(GROUP, VERSION, PLURAL, id="servicemonitor_recheck",
            interval=SERVICEMONITOR_RECHECK_SECONDS,
            initial_delay=SERVICEMONITOR_RECHECK_SECONDS, when=_recheck_servicemonitor)
async def servicemonitor_recheck(meta: kopf.Meta, namespace: str | None, **_: Any) -> None:
    """Reconcile an LLMDeployment whose wanted ServiceMonitor is missing although the CRD is
    now served (namespaced runs only, see above); otherwise do nothing."""
    client = get_client()
    name = meta.get("name")
    if not namespace or not name:
        return
    try:
        # Fresh: a cached "absent" (from a reconcile) would delay noticing the CRD by its TTL.
        if not await client.has_resource(SERVICEMONITORS, fresh=True):
            return
    except API_ERRORS as exc:
        # No answer (a proxy's 503, say): the next tick asks again. One line, not kopf's
        # traceback and 60 s timer backoff.
        _log.warning("asking API discovery for the ServiceMonitor API failed (checking "
                     "%s/%s again in %g s): %s", namespace, name,
                     SERVICEMONITOR_RECHECK_SECONDS, _describe(exc))
        return
    if await client.get(SERVICEMONITORS, namespace, name) is not None:
        return  # ours, or someone else's: a conflict is the reconciles' to report
    _log.info("the ServiceMonitor CRD is served and ServiceMonitor %s/%s is missing: "
              "reconciling its LLMDeployment", namespace, name)
    await _refresh_owner(namespace, name, reapply=True)


@kopf.on.event("", "v1", "pods", labels=_CHILD_LABELS)
async def pod_changed(meta: kopf.Meta, namespace: str | None, **_: Any) -> None:
    """Pod-level trouble (image pulls, scheduling, crashes) flows into the owner's status."""
    await _refresh_owner(namespace, meta.get("labels", {}).get(LABEL_LLMD))
from argosy_operator.autoscaling import timer as _autoscaling_timer  # noqa: E402,F401  (registers the autoscaling timer)
