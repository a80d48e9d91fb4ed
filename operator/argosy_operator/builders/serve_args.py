"""The `argosy serve` command line of the runtime container, derived from the spec."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from argosy_operator.constants import (
    BATCH_DIR,
    BATCH_MOUNT,
    LORA_FILE_KEY,
    LORA_MOUNT,
    RUNTIME_PORT,
)
from argosy_operator.spec import serves_lora_adapters


def speculative_json(speculative: Mapping[str, Any]) -> str:
    """spec.runtime.speculative (camelCase) -> the runtime's `--speculative` JSON (snake_case)."""
    out: dict[str, Any] = {
        "method": speculative["method"],
        "num_speculative_tokens": int(speculative["numSpeculativeTokens"]),
    }
    if speculative.get("draftModel"):
        out["model"] = speculative["draftModel"]
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def batch_dir(name: str, spec: Mapping[str, Any]) -> str:
    """`--batch-dir`: the LLMDeployment's folder on the shared claim, else the pod's /tmp."""
    return f"{BATCH_MOUNT}/{name}" if spec["runtime"].get("batchVolumeClaim") else BATCH_DIR


def serve_args(name: str, spec: Mapping[str, Any], model_path: str) -> list[str]:
    """Arguments after `argosy` for a normalized spec (see `spec.normalize_spec`) of the
    LLMDeployment `name`."""
    runtime = spec["runtime"]
    args = [
        "serve",
        "--model", model_path,
        "--served-model-name", spec["model"]["name"],
        "--host", "0.0.0.0",
        "--port", str(RUNTIME_PORT),
        "--dtype", runtime["dtype"],
    ]
    if runtime.get("quantization"):
        args += ["--quantization", runtime["quantization"]]
    args += ["--kv-cache-dtype", runtime["kvCacheDtype"]]
    if runtime.get("maxModelLen") is not None:
        args += ["--max-model-len", str(runtime["maxModelLen"])]
    args += ["--max-num-seqs", str(runtime["maxNumSeqs"])]
    args += ["--block-size", str(runtime["blockSize"])]
    args.append("--enable-prefix-caching" if runtime["prefixCaching"]
                else "--no-enable-prefix-caching")
    if runtime["batchInvariant"]:
        args.append("--batch-invariant")
    if runtime.get("speculative"):
        args += ["--speculative", speculative_json(runtime["speculative"])]
    if serves_lora_adapters(spec):
        # The file, not the list: the args (and so the pod template) must not change when
        # adapters do, or every change would roll every pod (builders/lora_configmap.py).
        args += ["--lora-modules-file", f"{LORA_MOUNT}/{LORA_FILE_KEY}"]
    # Flags, not ConfigMap entries: the runtime reads them once, so changing one rolls the pods.
    if runtime.get("maxLoras") is not None:
        args += ["--max-loras", str(runtime["maxLoras"])]
    if runtime.get("maxLoadedLoras") is not None:
        args += ["--max-loaded-loras", str(runtime["maxLoadedLoras"])]
    if runtime.get("toolCallParser"):
        args += ["--tool-call-parser", runtime["toolCallParser"]]
    if runtime.get("embeddingPooling"):
        args += ["--embedding-pooling", runtime["embeddingPooling"]]
    if runtime.get("reasoningParser"):
        args += ["--reasoning-parser", runtime["reasoningParser"]]
    if runtime.get("hfOverrides"):
        # Sorted keys: the same overrides always make the same args, so re-applying a
        # manifest whose keys moved does not roll the pods.
        args += ["--hf-overrides", json.dumps(runtime["hfOverrides"], sort_keys=True,
                                              separators=(",", ":"))]
    if spec["resources"]["gpus"] > 1:
        # One engine over every GPU of the pod (tensor parallel); `extraArgs` come last, so
        # `--tensor-parallel-size 1` there keeps one GPU for a model the GPUs do not divide.
        args += ["--tensor-parallel-size", str(spec["resources"]["gpus"])]
    args += ["--drain-timeout", str(runtime["drainTimeoutSeconds"])]
    args += ["--batch-dir", batch_dir(name, spec)]
    if runtime.get("maxWaiting") is not None:
        args += ["--max-waiting", str(runtime["maxWaiting"])]
    args += [str(a) for a in runtime.get("extraArgs", [])]
    return args
