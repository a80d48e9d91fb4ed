"""The `LLMDeployment` spec with its defaults filled in.

The API server applies the CRD's defaults before the operator sees an object, but objects
written before a field existed (or fed to the builders in tests) may lack them, so the
builders always work on `normalize_spec(spec)`. `DEFAULTS` must equal the defaults in
`crds/llmdeployments.argosy.dev.yaml`; a test checks the two against each other.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any

from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.constants import RUNTIME_IMAGE_CPU, RUNTIME_IMAGE_CUDA


class InvalidSpecError(ValueError):
    """A spec the operator cannot turn into children the API server accepts, raised before
    any child is written; the reconcile reports it as InvalidSpec and does not retry. Other
    errors (a ValueError from anywhere else included) are never taken for a refused spec."""


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

# The Prometheus Operator's Duration (its ServiceMonitor CRD's pattern for endpoint intervals):
# units largest first, each at most once. The LLMDeployment CRD's own pattern is looser
# ("1s1m", "15s15s" pass it), and such an interval would fail the ServiceMonitor with a 422 on
# every reconcile.
_PROMETHEUS_DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$")

# `argosy serve` flags that the children are built around, so `runtime.extraArgs` (appended
# last: the last flag wins) must not override them: the probes, the Service and the
# ServiceMonitor use port 8000 on every interface; `--model` is where the operator put the
# weights; clients, the gateway and status.model use spec.model.name; the LoRA file is the
# mounted ConfigMap. Overridden, the pods would never become ready (or serve something else)
# with no message naming the cause. Other flags may be overridden (docs/operator.md).
RESERVED_SERVE_FLAGS: dict[str, str] = {
    "--host": "the probes and the Service reach the runtime on every interface",
    "--port": "the probes, the Service and the ServiceMonitor use port 8000",
    "--model": "set spec.model.source or spec.model.path instead",
    "--served-model-name": "set spec.model.name instead",
    "--lora-modules-file": "set spec.runtime.loraAdapters instead",
}
# `argosy serve`'s parser expands an abbreviated long flag (argparse's allow_abbrev: `--por`
# is `--port`), so a prefix of a reserved flag is refused too, except the serve flags that are
# themselves such a prefix (an exact flag is never an abbreviation). The operator cannot import
# the runtime's parser (torch); a test checks this set against it.
SERVE_FLAGS_PREFIXING_RESERVED = frozenset({"--lora-modules"})


def _reserved_flag(flag: str) -> str | None:
    """The reserved flag that `flag` is or abbreviates, if any."""
    if flag in RESERVED_SERVE_FLAGS:
        return flag
    if len(flag) <= 2 or not flag.startswith("--") or flag in SERVE_FLAGS_PREFIXING_RESERVED:
        return None
    # A prefix of several flags is ambiguous to argparse (the runtime would refuse to start);
    # refused here as well, naming the first.
    return next((r for r in RESERVED_SERVE_FLAGS if r.startswith(flag)), None)

# Kubernetes' qualified names (label and annotation keys: an optional DNS-subdomain prefix
# and "/", then at most 63 characters) and label values (at most 63 characters). The CRD
# refuses bad ones in the label and annotation maps of the spec now, but an older CRD admitted
# any string, and the API server refuses the child that carries a bad one, after the children
# before it were applied.
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_metadata_map(field: str, values: Mapping[str, Any], *, labels: bool) -> None:
    # fullmatch: `$` alone also matches before a final newline, which Kubernetes refuses.
    for key, value in values.items():
        prefix, slash, name = str(key).rpartition("/")
        if (len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name)
                or (slash and (not prefix or len(prefix) > 253
                               or not _DNS_SUBDOMAIN.fullmatch(prefix)))):
            raise InvalidSpecError(
                f"{field}: {key!r} is not a valid key ([prefix/]name: a name of at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit; "
                "a DNS subdomain as prefix)")
        if labels and (len(str(value)) > 63 or (value and not _QUALIFIED_NAME.fullmatch(
                str(value)))):
            raise InvalidSpecError(
                f"{field}.{key}: {value!r} is not a valid label value (at most 63 letters, "
                "digits, '-', '_' or '.', starting and ending with a letter or digit, or empty)")


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


def with_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `spec` with the top-level defaults filled in, unchecked: for readers
    of a spec that may be invalid (the status of an LLMDeployment whose reconcile failed)."""
    return _merge_defaults(DEFAULTS, spec)


def normalize_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Return a deep copy of `spec` with every default filled in; raise InvalidSpecError,
    naming the field, on specs the builders cannot turn into children the API server accepts (the
    CRD rejects most of these before they get here; the rest it cannot express)."""
    _check_types(DEFAULTS, spec, "spec")
    if isinstance(spec.get("runtime"), Mapping):
        _check_types(SPECULATIVE_DEFAULTS, spec["runtime"].get("speculative") or {},
                     "spec.runtime.speculative")
    out = with_defaults(spec)
    model = out["model"]
    if not model.get("name"):
        raise InvalidSpecError("spec.model.name: required (the name clients send in 'model')")
    if bool(model.get("source")) == bool(model.get("path")):
        raise InvalidSpecError("spec.model: set exactly one of source or path")
    speculative = out["runtime"].get("speculative")
    if speculative is not None:
        out["runtime"]["speculative"] = _merge_defaults(SPECULATIVE_DEFAULTS, speculative)
        if out["runtime"]["speculative"]["method"] == "draft" and not speculative.get("draftModel"):
            raise InvalidSpecError(
                "spec.runtime.speculative.draftModel: required when method is draft")
    adapter_names = [a.get("name") for a in out["runtime"].get("loraAdapters") or []]
    if len(set(adapter_names)) != len(adapter_names) or model["name"] in adapter_names:
        raise InvalidSpecError("spec.runtime.loraAdapters: names must be unique and differ "
                               "from model.name")
    max_loras, max_loaded_loras = out["runtime"].get("maxLoras"), out["runtime"].get(
        "maxLoadedLoras")
    if max_loras is not None and max_loaded_loras is not None and max_loras > max_loaded_loras:
        # The runtime refuses to start otherwise (engine_args.check_max_loaded_loras): a
        # step runs only loaded adapters.
        raise InvalidSpecError("spec.runtime.maxLoras: must be <= runtime.maxLoadedLoras")
    if out["runtime"].get("quantization") == "int4" and out["runtime"]["dtype"] == "float32":
        raise InvalidSpecError(
            "spec.runtime.quantization: int4 needs dtype auto, float16 or bfloat16")
    if out["runtime"]["batchInvariant"]:
        _check_batch_invariant(out)
    tensor_parallel = tensor_parallel_size(out)
    if serves_lora_adapters(out) and tensor_parallel > 1:
        # The runtime refuses to start with a LoRA modules file under tensor parallelism (an
        # empty adapter list included: the file is passed all the same).
        raise InvalidSpecError(
            "spec.runtime.loraAdapters: cannot be served with tensor parallelism "
            f"(resources.gpus or --tensor-parallel-size: {tensor_parallel}), which "
            "does not split adapter weights over the GPUs: use resources.gpus 1 and more "
            "replicas")
    if out["runtime"].get("hfOverrides") and _is_gguf(out["model"]):
        raise InvalidSpecError("spec.runtime.hfOverrides: applies only to Hugging Face "
                               "folders; the runtime refuses it for a GGUF model")
    autoscaling = out["autoscaling"]
    if autoscaling["minReplicas"] > autoscaling["maxReplicas"]:
        raise InvalidSpecError("spec.autoscaling.minReplicas: must be <= maxReplicas")
    if autoscaling["enabled"]:
        # Every rule the autoscaler's timer checks, so that a policy it cannot run is refused
        # here (Degraded InvalidSpec) rather than only by the timer, which would scale nothing.
        # The CRD checks panicWindowSeconds <= stableWindowSeconds only since it has the rule.
        try:
            AutoscalingPolicy.from_spec(autoscaling)
        except ValueError as exc:
            raise InvalidSpecError(str(exc)) from exc
    _check_rollout(out["rollout"])
    if out["rollout"]["progressDeadlineSeconds"] <= out["runtime"]["startupTimeoutSeconds"]:
        raise InvalidSpecError("spec.rollout.progressDeadlineSeconds: must exceed "
                               "runtime.startupTimeoutSeconds")
    for field, values, labels in (
            ("spec.podTemplate.labels", out["podTemplate"].get("labels"), True),
            ("spec.podTemplate.annotations", out["podTemplate"].get("annotations"), False),
            ("spec.monitoring.labels", out["monitoring"].get("labels"), True),
            ("spec.service.annotations", out["service"].get("annotations"), False)):
        _check_metadata_map(field, values or {}, labels=labels)
    for field, quantity in (("spec.resources.cpu", out["resources"].get("cpu")),
                            ("spec.resources.memory", out["resources"].get("memory")),
                            ("spec.model.cacheSizeLimit", out["model"].get("cacheSizeLimit"))):
        # The CRD's quantity pattern admits a sign; the API server refuses negative sizes.
        if quantity is not None and str(quantity).startswith("-"):
            raise InvalidSpecError(f"{field}: {quantity!r} must not be negative")
    for arg in out["runtime"]["extraArgs"]:
        flag = str(arg).split("=", 1)[0]
        reserved = _reserved_flag(flag)
        if reserved == flag:
            raise InvalidSpecError(f"spec.runtime.extraArgs: {flag} is set by the operator "
                                   f"and cannot be overridden ({RESERVED_SERVE_FLAGS[flag]})")
        if reserved is not None:
            raise InvalidSpecError(f"spec.runtime.extraArgs: {flag} abbreviates {reserved}, "
                                   f"which is set by the operator and cannot be overridden "
                                   f"({RESERVED_SERVE_FLAGS[reserved]})")
    interval = str(out["monitoring"]["interval"])
    # fullmatch: `$` alone also matches before a final newline, which Prometheus refuses.
    if not interval or not _PROMETHEUS_DURATION.fullmatch(interval):
        raise InvalidSpecError(
            f"spec.monitoring.interval: {interval!r} is not a Prometheus duration (units from "
            "largest to smallest, each once: 30s, 1m30s, 500ms)")
    if out["replicas"] < 0:
        raise InvalidSpecError("spec.replicas: must be >= 0")
    return out


# Fields with a default whose CRD type is int-or-string (a number or a percentage).
_INT_OR_STRING = frozenset({"spec.rollout.maxSurge", "spec.rollout.maxUnavailable"})


def _check_types(defaults: Mapping[str, Any], given: Any, path: str) -> None:
    """InvalidSpecError naming the first field whose value is not of its default's type.

    The CRD's schema refuses these, but an LLMDeployment created under an older CRD (before
    the field had its schema), or with validation off, reaches the operator as written: a
    `replicas: "2"` then failed as a TypeError deep in a builder, retried forever with a
    traceback and never reported on the object."""
    if not isinstance(given, Mapping):
        raise InvalidSpecError(f"{path}: must be an object, got {_json_type(given)}")
    for key, default in defaults.items():
        value = given.get(key)
        field = f"{path}.{key}"
        if value is None:
            continue
        if isinstance(default, Mapping):
            _check_types(default, value, field)
            continue
        if field in _INT_OR_STRING:
            ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):  # an integer is a number too (YAML `1`)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise InvalidSpecError(f"{field}: must be {_json_type(default)}, got "
                                   f"{_json_type(value)} {value!r:.60} (the installed CRD may "
                                   "be older than the operator: apply crds/ again)")


def _json_type(value: Any) -> str:
    """The JSON Schema type name of a value, as the CRD and kubectl's errors name it."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (Mapping, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _check_batch_invariant(spec: Mapping[str, Any]) -> None:
    """The combinations the runtime refuses at startup with --batch-invariant
    (argosy_runtime.batch_invariance.check_batch_invariant_options); the CRD's CEL rules
    reject the same ones at apply time."""
    runtime = spec["runtime"]
    if runtime["dtype"] not in ("auto", "bfloat16"):
        raise InvalidSpecError("spec.runtime.batchInvariant: needs runtime.dtype auto or "
                               "bfloat16 (not float32 or float16)")
    if spec["resources"]["gpus"] > 0:
        raise InvalidSpecError("spec.runtime.batchInvariant: runs on CPUs only: resources.gpus "
                               "must be 0")


# A rollout count: a number or a percentage (apps/v1 reads "00%" as 0, as the CRD's rules do).
_ROLLOUT_COUNT = re.compile(r"([0-9]+)(%?)")


def _check_rollout(rollout: Mapping[str, Any]) -> None:
    """What apps/v1 refuses in a RollingUpdate, on every reconcile (the CRD's rules, which
    an older CRD lacked: it admitted maxUnavailable "150%", "00%" for 0 and negative counts)."""
    counts = {}
    for key in ("maxSurge", "maxUnavailable"):
        match = _ROLLOUT_COUNT.fullmatch(str(rollout[key]))
        if match is None:
            raise InvalidSpecError(f"spec.rollout.{key}: {rollout[key]!r} is not a count or a "
                                   "percentage (e.g. 1 or 25%)")
        counts[key] = (int(match[1]), match[2])
    if counts["maxSurge"][0] == 0 and counts["maxUnavailable"][0] == 0:
        raise InvalidSpecError("spec.rollout: maxSurge and maxUnavailable cannot both be 0")
    if counts["maxUnavailable"][1] and counts["maxUnavailable"][0] > 100:
        raise InvalidSpecError("spec.rollout.maxUnavailable: must not be greater than 100%")


def _is_gguf(model: Mapping[str, Any]) -> bool:
    """Whether the model is one GGUF file by its spec (the runtime also takes a folder that
    holds one, which only it can see)."""
    location = str(model.get("source") or model.get("path") or "")
    return model["format"] == "gguf" or location.lower().endswith(".gguf")


def runtime_image(spec: Mapping[str, Any]) -> str:
    """The runtime image: spec.runtime.image, else the CUDA image with GPUs, else the CPU one."""
    image = spec["runtime"].get("image")
    if image:
        return str(image)
    return RUNTIME_IMAGE_CUDA if spec["resources"]["gpus"] > 0 else RUNTIME_IMAGE_CPU


def _extra_arg_values(spec: Mapping[str, Any], flag: str, aliases: tuple[str, ...] = ()
                      ) -> list[str]:
    """The values runtime.extraArgs gives the `argosy serve` flag `flag` (`--flag value` or
    `--flag=value`; also under its short `aliases`), in order: they come after the operator's
    own flags, and the runtime keeps the last. argparse also takes an unambiguous
    abbreviation: the callers' flags are the only serve flags starting with their first two
    letters (`--dr`, `--te`), so any prefix that long is one."""
    args = [str(a) for a in spec["runtime"].get("extraArgs") or []]
    values = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in aliases and (len(name) < 4 or not flag.startswith(name)):
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        values.append(value)
    return values


def drain_timeout_seconds(spec: Mapping[str, Any]) -> float:
    """The drain timeout the runtime will use: `--drain-timeout` in runtime.extraArgs if
    there, else runtime.drainTimeoutSeconds."""
    drain = float(spec["runtime"]["drainTimeoutSeconds"])
    for value in _extra_arg_values(spec, "--drain-timeout"):
        try:
            seconds = float(value)
        except ValueError:
            continue  # the runtime refuses to start on it; the field's value is as good
        if math.isfinite(seconds):
            drain = max(0.0, seconds)
    return drain


def tensor_parallel_size(spec: Mapping[str, Any]) -> int:
    """The GPUs (ranks) the runtime will split the model over: `--tensor-parallel-size` (or
    `-tp`) in runtime.extraArgs if there, else resources.gpus (the operator passes it when
    above 1)."""
    size = max(1, spec["resources"]["gpus"])
    for value in _extra_arg_values(spec, "--tensor-parallel-size", aliases=("-tp",)):
        try:
            size = int(value)
        except ValueError:
            continue  # the runtime refuses to start on it
    return size


def termination_grace_seconds(spec: Mapping[str, Any]) -> int:
    """preStop pause + drain timeout + a margin, so the kubelet never kills a draining server.

    The drain timeout as the runtime sees it: a `--drain-timeout` in extraArgs raised the
    server's drain past the grace period, and the kubelet killed it mid-drain."""
    runtime = spec["runtime"]
    return int(runtime["preStopSleepSeconds"] + math.ceil(drain_timeout_seconds(spec))
               + GRACE_MARGIN_SECONDS)


def autoscaling_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled", False))


def max_replicas(spec: Mapping[str, Any]) -> int:
    """The most replicas this spec can run (the PodDisruptionBudget matters only above one)."""
    if autoscaling_enabled(spec):
        return int(spec["autoscaling"]["maxReplicas"])
    return int(spec["replicas"])


def serves_lora_adapters(spec: Mapping[str, Any]) -> bool:
    """Whether spec.runtime.loraAdapters is set. An empty list counts: the adapter file stays
    mounted so that adapters can come and go later without touching the pod template."""
    return spec["runtime"].get("loraAdapters") is not None
