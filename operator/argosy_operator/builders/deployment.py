"""The runtime Deployment of an LLMDeployment."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import child_metadata, common_labels, selector_labels
from argosy_operator.builders.download import download_container
from argosy_operator.builders.security import container_security_context, pod_security_context
from argosy_operator.builders.serve_args import serve_args
from argosy_operator.constants import (
    BATCH_MOUNT,
    BATCH_VOLUME,
    LORA_MOUNT,
    LORA_VOLUME,
    MODEL_MOUNT,
    MODEL_VOLUME,
    RUNTIME_CONTAINER,
    RUNTIME_PORT,
    RUNTIME_PORT_NAME,
    SHM_VOLUME,
    TMP_VOLUME,
)
from argosy_operator.model_source import PVC_MOUNT, ModelSource, parse_model_source
from argosy_operator.spec import (
    InvalidSpecError,
    runtime_image,
    serves_lora_adapters,
    termination_grace_seconds,
)

STARTUP_PROBE_PERIOD = 10
# Shared memory for the CUDA runtime's IPC (the container default of 64 MiB is too small).
SHM_SIZE = "1Gi"


def _probe(path: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": RUNTIME_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _count_or_percent(value: int | str) -> int | str:
    """A rollout count the CRD admits as a string ("1", like "25%") as the integer the
    Deployment needs: the API server refuses a string there unless it is a percentage."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _resources(spec: Mapping[str, Any], source: ModelSource) -> dict[str, Any]:
    res = spec["resources"]
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.get("cpu") is not None:
        requests["cpu"] = str(res["cpu"])  # no CPU limit: throttling stalls decode steps
    if res.get("memory") is not None:
        requests["memory"] = limits["memory"] = str(res["memory"])
    if source.needs_download and spec["model"].get("cacheSizeLimit"):
        # The downloaded weights fill the emptyDir up to its sizeLimit: requested, the pod is
        # scheduled only where that much node disk is free, instead of being evicted midway
        # through a download that fills the node's disk (and downloading again elsewhere).
        requests["ephemeral-storage"] = str(spec["model"]["cacheSizeLimit"])
    if res["gpus"] > 0:
        # Extended resources: the limit is what counts; the request must equal it.
        requests[res["gpuResourceName"]] = limits[res["gpuResourceName"]] = str(res["gpus"])
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _cpu_and_memory(resources: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime container's CPU and memory, for the download init container: a namespace
    whose ResourceQuota covers memory refuses every pod with a container that sets none (the
    ReplicaSet then creates no pod at all), and an init container as large as the runtime
    leaves the pod's effective request unchanged (the larger of the two counts)."""
    out = {}
    for kind, amounts in resources.items():
        kept = {k: v for k, v in amounts.items() if k in ("cpu", "memory")}
        if kept:
            out[kind] = kept
    return out


def _volumes(name: str, spec: Mapping[str, Any], source: ModelSource
             ) -> tuple[list[dict], list[dict]]:
    """(pod volumes, runtime container mounts); `name` is the LLMDeployment's."""
    volumes: list[dict[str, Any]] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": TMP_VOLUME, "mountPath": "/tmp"}]
    if source.needs_download:
        empty_dir: dict[str, Any] = {}
        if spec["model"].get("cacheSizeLimit"):
            empty_dir["sizeLimit"] = str(spec["model"]["cacheSizeLimit"])
        volumes.append({"name": MODEL_VOLUME, "emptyDir": empty_dir})
        mounts.append({"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True})
    elif source.kind == "pvc":
        volumes.append({"name": MODEL_VOLUME, "persistentVolumeClaim": {
            "claimName": source.location, "readOnly": True}})
        mounts.append({"name": MODEL_VOLUME, "mountPath": PVC_MOUNT, "readOnly": True})
    if spec["resources"]["gpus"] > 0:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": SHM_SIZE}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if spec["runtime"].get("batchVolumeClaim"):
        # Shared by every replica (ReadWriteMany): batches outlive their pod (docs/batch.md).
        volumes.append({"name": BATCH_VOLUME, "persistentVolumeClaim": {
            "claimName": spec["runtime"]["batchVolumeClaim"]}})
        mounts.append({"name": BATCH_VOLUME, "mountPath": BATCH_MOUNT})
    if serves_lora_adapters(spec):
        # The LoRA ConfigMap (same name as the LLMDeployment). A whole-directory mount: the
        # kubelet refreshes it in place (a subPath mount would never see an update).
        volumes.append({"name": LORA_VOLUME, "configMap": {"name": name}})
        mounts.append({"name": LORA_VOLUME, "mountPath": LORA_MOUNT, "readOnly": True})
    template = spec["podTemplate"]
    volumes += _unique("spec.podTemplate.volumes", "name", volumes, template.get("volumes", []))
    mounts += _unique("spec.podTemplate.volumeMounts", "mountPath", mounts,
                      template.get("volumeMounts", []))
    names = [v.get("name") for v in volumes]  # a list: the message must not vary
    for mount in mounts:
        if mount.get("name") not in names:  # the API server's 422 "Not found", likewise
            raise InvalidSpecError(
                f"spec.podTemplate.volumeMounts: name {mount.get('name')!r} is no volume of "
                f"the pod ({', '.join(repr(n) for n in names)}); add it to "
                "spec.podTemplate.volumes")
    return volumes, mounts


def _unique(field: str, key: str, operators: list[dict[str, Any]],
            extra: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`extra` (the spec's) as dicts; InvalidSpecError when one repeats a `key` of the
    operator's entries or of an earlier one. The API server refuses the Deployment then
    (422 "Duplicate value"), which was ApplyFailed, retried forever, never Stalled."""
    ours = ", ".join(repr(e.get(key)) for e in operators)
    seen = {e.get(key): f"is the operator's (this spec's pods already have {ours})"
            for e in operators}
    out = []
    for entry in extra:
        value = entry.get(key)
        if value in seen:
            raise InvalidSpecError(f"{field}: {key} {value!r} {seen[value]}; use another {key}")
        seen[value] = "is given twice"
        out.append(dict(entry))
    return out


def _env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    # Caches on the writable /tmp (the root filesystem is read-only).
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"},
    ]
    user = [dict(e) for e in spec["runtime"].get("env", [])]
    user_names = {e.get("name") for e in user}
    return [e for e in env if e["name"] not in user_names] + user


def _pod_spec(name: str, spec: Mapping[str, Any], source: ModelSource) -> dict[str, Any]:
    runtime = spec["runtime"]
    res = spec["resources"]
    template = spec["podTemplate"]
    image = runtime_image(spec)
    volumes, mounts = _volumes(name, spec, source)
    container: dict[str, Any] = {
        "name": RUNTIME_CONTAINER,
        "image": image,
        "imagePullPolicy": runtime["imagePullPolicy"],
        "command": ["argosy"],
        "args": serve_args(name, spec, source.serve_path),
        "ports": [{"name": RUNTIME_PORT_NAME, "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec, source),
        "volumeMounts": mounts,
        # Loading weights can take minutes: the startup probe holds liveness off until then.
        "startupProbe": _probe("/health", period=STARTUP_PROBE_PERIOD, timeout=5, failures=max(
            1, math.ceil(runtime["startupTimeoutSeconds"] / STARTUP_PROBE_PERIOD))),
        "readinessProbe": _probe("/ready", period=5, timeout=3, failures=2),
        "livenessProbe": _probe("/health", period=15, timeout=5, failures=4),
        "securityContext": container_security_context(),
    }
    if runtime["preStopSleepSeconds"] > 0:
        # Keep serving while endpoints and load balancers drop the pod; SIGTERM (drain) follows.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": runtime["preStopSleepSeconds"]}}}
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "enableServiceLinks": False,
        # The runtime never talks to the API server.
        "automountServiceAccountToken": bool(template.get("serviceAccountName")),
    }
    if source.needs_download:
        init = download_container(spec, source, image, runtime["imagePullPolicy"])
        if cpu_memory := _cpu_and_memory(container["resources"]):
            init["resources"] = cpu_memory
        pod["initContainers"] = [init]
    if template.get("serviceAccountName"):
        pod["serviceAccountName"] = template["serviceAccountName"]
    if template.get("imagePullSecrets"):
        pod["imagePullSecrets"] = [{"name": n} for n in template["imagePullSecrets"]]
    if res.get("nodeSelector"):
        pod["nodeSelector"] = dict(res["nodeSelector"])
    tolerations = [dict(t) for t in res.get("tolerations", [])]
    if res["gpus"] > 0 and not any(t.get("key") == res["gpuResourceName"] for t in tolerations):
        # GPU node pools are commonly tainted with the GPU resource name.
        tolerations.insert(0, {"key": res["gpuResourceName"], "operator": "Exists",
                               "effect": "NoSchedule"})
    if tolerations:
        pod["tolerations"] = tolerations
    for key in ("affinity",):
        if res.get(key):
            pod[key] = res[key]
    for key in ("runtimeClassName", "priorityClassName"):
        if res.get(key):
            pod[key] = res[key]
    return pod


def build_deployment(llmd: Mapping[str, Any], spec: Mapping[str, Any],
                     replicas: int | None) -> dict[str, Any]:
    """The Deployment for a normalized spec. `replicas=None` leaves spec.replicas out (when the
    autoscaler owns it and the Deployment exists)."""
    name = llmd["metadata"]["name"]
    source = parse_model_source(spec["model"].get("source"), spec["model"].get("path"),
                                spec["model"]["format"])
    template = spec["podTemplate"]
    pod_labels = {**template.get("labels", {}), **common_labels(name)}
    pod_annotations = {
        "kubectl.kubernetes.io/default-container": RUNTIME_CONTAINER,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(RUNTIME_PORT),
        "prometheus.io/path": "/metrics",
        **template.get("annotations", {}),
    }
    rollout = spec["rollout"]
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": _count_or_percent(rollout["maxSurge"]),
            "maxUnavailable": _count_or_percent(rollout["maxUnavailable"])}},
        "progressDeadlineSeconds": rollout["progressDeadlineSeconds"],
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": pod_labels, "annotations": pod_annotations},
            "spec": _pod_spec(name, spec, source),
        },
    }
    if replicas is not None:
        deployment_spec = {"replicas": int(replicas), **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(llmd),
        "spec": deployment_spec,
    }
