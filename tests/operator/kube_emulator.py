"""A stricter in-memory Kubernetes API for the handler tests, on kmock's KubernetesEmulator.

kmock stores objects and streams watch events; this subclass adds what the operator relies
on in a real API server: uid / resourceVersion / generation / creationTimestamp, generateName,
no-op patches that change nothing (no resourceVersion bump, no watch event), resourceVersion
preconditions (409 Conflict), the status subresource (status-only patches on /status, status
ignored on the main resource), label selectors on list/watch, watches that resume from a
resourceVersion, the garbage collector's cascading deletion by owner references, and a
CustomResourceDefinition created through the API established and serving its resource
(discovery, objects) at once; deleting a CRD is not emulated. Like the API server it also
refuses (422) objects whose label keys or values are not valid, and Services whose name is
not a DNS-1035 label (the object-level validation a child of an unusual name runs into).
The Deployment controller, scheduler and kubelet are not emulated: tests write the children's
status and the pods themselves.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import dicts, enums, rendering

RESOURCES: dict[str, dict[str, Any]] = {
    "argosy.dev/v1alpha1/llmdeployments": dict(
        kind="LLMDeployment", namespaced=True, subresources={"status", "scale"},
        verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True, subresources={"status"},
                                verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "v1/pods": dict(kind="Pod", namespaced=True, subresources={"status"},
                    verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "v1/configmaps": dict(kind="ConfigMap", namespaced=True,
                          verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "v1/services": dict(kind="Service", namespaced=True, subresources={"status"},
                        verbs={"list", "watch", "get", "create", "patch", "delete"}),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True,
                                           subresources={"status"},
                                           verbs={"list", "watch", "get", "create", "patch",
                                                  "delete"}),
    "v1/events": dict(kind="Event", namespaced=True, verbs={"create", "list", "watch"}),
    "v1/namespaces": dict(kind="Namespace", namespaced=False, verbs={"list", "watch", "get"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"}),
}
SERVICEMONITORS = {"monitoring.coreos.com/v1/servicemonitors": dict(
    kind="ServiceMonitor", namespaced=True,
    verbs={"list", "watch", "get", "create", "patch", "delete"})}
# The Prometheus Operator's CRD object (schema left out), for a test that installs it while
# the operator runs; SERVICEMONITORS declares the same resource at the emulator's start.
SERVICEMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"plural": "servicemonitors", "singular": "servicemonitor",
                       "kind": "ServiceMonitor", "listKind": "ServiceMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {
                               "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, comma-separated."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _object_errors(plural: str, obj: Mapping[str, Any]) -> list[str]:
    """The API server's checks of metadata.labels (every kind) and of a Service's name (Go
    regexps: `$` is the end of the text, so fullmatch, not a trailing newline too)."""
    meta = obj.get("metadata") or {}
    errors = []
    name = meta.get("name") or ""
    if plural == "services" and (len(name) > 63 or not _DNS1035.fullmatch(name)):
        errors.append(f"metadata.name: Invalid value: {name!r}: a DNS-1035 label must consist "
                      "of lower case alphanumeric characters or '-', start with an alphabetic "
                      "character, and end with an alphanumeric character")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (len(label) > 63 or not _LABEL_NAME.fullmatch(label)
                or (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)))):
            errors.append(f"metadata.labels: Invalid value: {key!r}: not a valid label key")
        if not isinstance(value, str) or len(value) > 63 or (
                value and not _LABEL_NAME.fullmatch(value)):
            errors.append(f"metadata.labels: Invalid value: {value!r}: a valid label must be "
                          "an empty string or consist of alphanumeric characters, '-', '_' or "
                          "'.', and must start and end with an alphanumeric character "
                          "(at most 63 characters)")
    return errors


def _diff(current: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """The exact JSON merge patch from `current` to `target`."""
    out: dict[str, Any] = {}
    for key, value in target.items():
        if isinstance(value, dict) and isinstance(current.get(key), dict):
            sub = _diff(current[key], value)
            if sub:
                out[key] = sub
        elif key not in current or current[key] != value:
            out[key] = value
    for key in current:
        if key not in target:
            out[key] = None
    return out


class ArgosyKubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour listed in the module docstring.

    With `crd_validation` (the default), LLMDeployments are defaulted and validated against
    the CRD's schema and CEL rules on create and patch (422 Invalid otherwise), as the API
    server does with the CRD installed.
    """

    crd_validation = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv_counter = itertools.count(1)
        self.last_rv = 0

    def _admit(self, request: rendering.Request, obj: dict[str, Any]) -> dict[str, Any]:
        """Default + validate an LLMDeployment; returns the defaulted object. Every object's
        labels (and a Service's name) are checked as the API server does."""
        if errors := _object_errors(request.resource.plural, obj):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="; ".join(errors))
        if not self.crd_validation or request.resource.plural != "llmdeployments" \
                or request.subresource:
            return obj
        from crd_schema import validate

        # Status is written through its subresource; validate what users write.
        without_status = {k: v for k, v in obj.items() if k != "status"}
        defaulted, errors = validate(without_status)
        if errors:
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message="; ".join(errors))
        if "status" in obj:
            defaulted["status"] = obj["status"]
        return defaulted

    def declare(self, resources: Mapping[str, Mapping[str, Any]]) -> None:
        for key, info in resources.items():
            self.resources[key] = kmock.ResourceInfo(**info)

    def _next_rv(self) -> str:
        self.last_rv = next(self._rv_counter)
        return str(self.last_rv)

    def _has_status(self, resource: Any) -> bool:
        for res in self.resources:
            if res == resource:
                return "status" in self.resources[res].subresources
        return False

    def _live(self, resource: Any, namespace: str | None, name: str) -> Any:
        for (res, ns, n), obj in self.objects.items():
            if res == resource and ns == namespace and n == name and not obj.deleted:
                return obj
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.action == enums.action.CREATE:
            self._prepare_create(request)
        elif (request.resource is not None and request.action == enums.action.UPDATE
              and isinstance(request.data, dict)):
            noop = self._prepare_patch(request)
            if noop is not None:
                return aiohttp.web.json_response(noop)
        response = await super()._handle(request)
        if request.resource is not None and request.action in (enums.action.DELETE,
                                                               enums.action.CREATE):
            # Like the real collector, also for an object created with an owner already gone.
            await self._collect_garbage()
        return response

    def _prepare_create(self, request: rendering.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = self._next_rv()
        meta["generation"] = 1
        if self._has_status(request.resource):
            request.data.pop("status", None)
        request.data.update(self._admit(request, request.data))
        if request.resource.plural == "customresourcedefinitions":
            self._establish(request.data)

    def _establish(self, crd: dict[str, Any]) -> None:
        """Serve a new CRD's resource and mark it Established, before its ADDED event goes
        out: a watcher that reacts to the event (kopf's CRD scanning, the operator's handler)
        finds the resource in discovery, as it does once the API server has established the
        CRD (which a real one reports in a later MODIFIED event)."""
        crd["status"] = {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                        {"type": "Established", "status": "True"}]}
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            if version.get("served", True):
                key = f"{spec['group']}/{version['name']}/{names['plural']}"
                self.declare({key: dict(
                    kind=names["kind"], namespaced=spec["scope"] == "Namespaced",
                    subresources=set(version.get("subresources") or ()),
                    verbs={"list", "watch", "get", "create", "patch", "delete"})})

    def _prepare_patch(self, request: rendering.Request) -> dict[str, Any] | None:
        """Rewrite the merge patch like the API server would; return the object for a no-op."""
        obj = self._live(request.resource, request.namespace, request.name)
        if obj is None:
            return None  # kmock answers 404
        current = obj.raw
        patch: dict[str, Any] = request.data
        want_rv = (patch.get("metadata") or {}).pop("resourceVersion", None)
        if want_rv is not None and want_rv != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f"the object has been modified (resourceVersion {want_rv} is stale)")
        if request.subresource == "status":
            for key in list(patch):
                if key != "status":
                    del patch[key]
        elif self._has_status(request.resource):
            patch.pop("status", None)
        updated = self._admit(request, dict(dicts.patch_dict(copy.deepcopy(current), patch)))
        if updated == current:
            return current
        # Store exactly the admitted object: rewrite the request as the merge patch from the
        # current object to it (defaults filled in, removed keys nulled).
        exact = _diff(current, updated)
        patch.clear()
        patch.update(exact)
        meta = patch.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_rv()
        if updated.get("spec") != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        return None

    async def _collect_garbage(self) -> None:
        """Background cascading deletion: delete objects whose owners are all gone."""
        while True:
            async with self._lock:
                alive = {o.raw["metadata"].get("uid") for o in self.objects.values()
                         if not o.deleted}
                orphans = [(res, o) for (res, _, _), o in self.objects.items()
                           if not o.deleted and o.raw["metadata"].get("ownerReferences")
                           and not any(ref.get("uid") in alive
                                       for ref in o.raw["metadata"]["ownerReferences"])]
                for res, o in orphans:
                    raw = o.raw
                    o.delete()
                    await self._buses[res].put({"type": "DELETED", "object": raw})
            if not orphans:
                return

    def _visible(self, request: rendering.Request, raw: Mapping[str, Any]) -> bool:
        meta = raw.get("metadata") or {}
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        return _selector_matches(request.params.get("labelSelector"), meta.get("labels") or {})

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if not any(res == request.resource for res in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = [o.raw for (res, _, _), o in self.objects.items()
                     if res == request.resource and not o.deleted and self._visible(request, o.raw)]
        return {"kind": "List", "metadata": {"resourceVersion": str(self.last_rv)},
                "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""
        since_raw = request.params.get("resourceVersion") or "0"
        since = int(since_raw) if since_raw.isdigit() else 0
        async with self._lock:
            replay = [{"type": "ADDED", "object": o.raw}
                      for (res, _, _), o in self.objects.items()
                      if res == request.resource and not o.deleted
                      and int(o.raw["metadata"].get("resourceVersion", 0)) > since
                      and self._visible(request, o.raw)]
        for event in replay:
            yield event
        async for event in self._buses[request.resource]:
            if self._visible(request, event.get("object") or {}):
                yield event
