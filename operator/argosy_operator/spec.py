"""The `LLMDeployment` spec with its defaults filled in.

The API server applies the CRD's defaults before the operator sees an object, but objects
written before a field existed (or fed to the builders in tests) may lack them, so the
builders always work on `normalize_spec(spec)`. `DEFAULTS` must equal the defaults in
`crds/llmdeployments.argosy.dev.yaml`; a test checks the two against each other.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from argosy_operator.constants import RUNTIME_IMAGE_CPU, RUNTIME_IMAGE_CUDA

# Nested objects whose keys get defaults. Optional fields without a default are absent here.
DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "model": {"format": "auto"},
    "runtime": {
        "imagePullPolicy": "IfNotPresent",
        "dtype": "auto",
        "kvCacheDtype": "auto",
        "maxNumSeqs": 256,
        "blockSize": 16,
        "prefixCaching": True,
        "batchInvariant": False,
        "drainTimeoutSeconds": 30,
        "preStopSleepSeconds": 5,
        "startupTimeoutSeconds": 1800,
        "extraArgs": [],
        "env": [],
    },
    "resources": {"gpus": 0, "gpuResourceName": "nvidia.com/gpu"},
    "autoscaling": {
        "enabled": False,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetKVCacheUtilization": 0.7,
        "targetQueueDepth": 4,
        "tolerance": 0.1,
        "stableWindowSeconds": 60,
        "panicWindowSeconds": 6,
        "panicThreshold": 2.0,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
        "maxScaleUpRate": 2.0,
        "maxScaleDownRate": 0.5,
        "scrapeIntervalSeconds": 5,
        "scaleToZeroIdleSeconds": 600,
    },
    "service": {"port": 8000, "type": "ClusterIP"},
    "monitoring": {"serviceMonitor": True, "interval": "15s"},
    "rollout": {"maxSurge": 1, "maxUnavailable": 0, "progressDeadlineSeconds": 2400},
    "podTemplate": {},
}

# Defaults of objects nested inside optional objects (applied only when the object is given).
SPECULATIVE_DEFAULTS: dict[str, Any] = {"method": "ngram", "numSpeculativeTokens": 4}

# Seconds between SIGTERM's drain deadline and the kubelet's SIGKILL: process exit, flushing.
GRACE_MARGIN_SECONDS = 15


def _merge_defaults(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(given))
    for key, default in defaults.items():
        if key not in out or out[key] is None:
            out[key] = copy.deepcopy(default)
        elif isinstance(default, Mapping) and isinstance(out[key], Mapping):
            out[key] = _merge_defaults(default, out[key])
    return out


def normalize_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Return a deep copy of `spec` with every default filled in; raise ValueError on specs
    the builders cannot turn into manifests (the CRD rejects these before they get here)."""
    out = _merge_defaults(DEFAULTS, spec)
    model = out["model"]
    if not model.get("name"):
        raise ValueError("spec.model.name: required (the name clients send in 'model')")
    if bool(model.get("source")) == bool(model.get("path")):
        raise ValueError("spec.model: set exactly one of source or path")
    speculative = out["runtime"].get("speculative")
    if speculative is not None:
        out["runtime"]["speculative"] = _merge_defaults(SPECULATIVE_DEFAULTS, speculative)
        if out["runtime"]["speculative"]["method"] == "draft" and not speculative.get("draftModel"):
            raise ValueError("spec.runtime.speculative.draftModel: required when method is draft")
    adapter_names = [a.get("name") for a in out["runtime"].get("loraAdapters") or []]
    if len(set(adapter_names)) != len(adapter_names) or model["name"] in adapter_names:
        raise ValueError("spec.runtime.loraAdapters: names must be unique and differ from "
                         "model.name")
    max_loras, max_loaded_loras = out["runtime"].get("maxLoras"), out["runtime"].get(
        "maxLoadedLoras")
    if max_loras is not None and max_loaded_loras is not None and max_loras > max_loaded_loras:
        # The runtime refuses to start otherwise (engine_args.check_max_loaded_loras): a
        # step runs only loaded adapters.
        raise ValueError("spec.runtime.maxLoras: must be <= runtime.maxLoadedLoras")
    if out["runtime"].get("quantization") == "int4" and out["runtime"]["dtype"] == "float32":
        raise ValueError("spec.runtime.quantization: int4 needs dtype auto, float16 or bfloat16")
    if out["runtime"]["batchInvariant"]:
        _check_batch_invariant(out)
    autoscaling = out["autoscaling"]
    if autoscaling["minReplicas"] > autoscaling["maxReplicas"]:
        raise ValueError("spec.autoscaling.minReplicas: must be <= maxReplicas")
    if out["rollout"]["progressDeadlineSeconds"] <= out["runtime"]["startupTimeoutSeconds"]:
        raise ValueError("spec.rollout.progressDeadlineSeconds: must exceed "
                         "runtime.startupTimeoutSeconds")
    if out["replicas"] < 0:
        raise ValueError("spec.replicas: must be >= 0")
    return out


def _check_batch_invariant(spec: Mapping[str, Any]) -> None:
    """The combinations the runtime refuses at startup with --batch-invariant
    (argosy_runtime.batch_invariance.check_batch_invariant_options); the CRD's CEL rules
    reject the same ones at apply time."""
    runtime = spec["runtime"]
    if runtime["dtype"] not in ("auto", "bfloat16"):
        raise ValueError("spec.runtime.batchInvariant: needs runtime.dtype auto or bfloat16 "
                         "(not float32 or float16)")
    if spec["resources"]["gpus"] > 0:
        raise ValueError("spec.runtime.batchInvariant: runs on CPUs only: resources.gpus "
                         "must be 0")


def runtime_image(spec: Mapping[str, Any]) -> str:
    """The runtime image: spec.runtime.image, else the CUDA image with GPUs, else the CPU one."""
    image = spec["runtime"].get("image")
    if image:
        return str(image)
    return RUNTIME_IMAGE_CUDA if spec["resources"]["gpus"] > 0 else RUNTIME_IMAGE_CPU


def termination_grace_seconds(spec: Mapping[str, Any]) -> int:
    """preStop pause + drain timeout + a margin, so the kubelet never kills a draining server."""
    runtime = spec["runtime"]
    return int(runtime["preStopSleepSeconds"] + runtime["drainTimeoutSeconds"]
               + GRACE_MARGIN_SECONDS)


def autoscaling_enabled(spec: Mapping[str, Any]) -> bool:
    return bool(spec.get("autoscaling", {}).get("enabled", False))


def max_replicas(spec: Mapping[str, Any]) -> int:
    """The most replicas this spec can run (the PodDisruptionBudget matters only above one)."""
    if autoscaling_enabled(spec):
        return int(spec["autoscaling"]["maxReplicas"])
    return int(spec["replicas"])


def serves_lora_adapters(spec: Mapping[str, Any]) -> bool:
    """Whether spec.runtime.loraAdapters is set. An empty list counts: the adapter file stays
    mounted so that adapters can come and go later without touching the pod template."""
    return spec["runtime"].get("loraAdapters") is not None
