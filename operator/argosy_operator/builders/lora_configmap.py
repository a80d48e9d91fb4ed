"""The ConfigMap that lists the LoRA adapters the runtime serves beside the model.

The runtime watches the file (`--lora-modules-file`) and loads or unloads adapters as it
changes, so the adapter list lives here rather than in the pod template: changing it patches
this ConfigMap, and the kubelet refreshes the mounted file in place (within about a minute,
atomically: the runtime never reads a half-written file). No pod restarts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from argosy_operator.builders.common import child_metadata
from argosy_operator.constants import LORA_FILE_KEY
from argosy_operator.spec import serves_lora_adapters


def lora_adapters_json(adapters: list[Mapping[str, Any]]) -> str:
    """`[{name, path}]` -> the file's `{"name": "path", ...}`, in a stable form (sorted keys,
    no spaces) so an unchanged list never produces a patch."""
    return json.dumps({a["name"]: a["path"] for a in adapters}, sort_keys=True,
                      separators=(",", ":"))


def build_lora_configmap(llmd: Mapping[str, Any], spec: Mapping[str, Any]
                         ) -> dict[str, Any] | None:
    """None when spec.runtime.loraAdapters is absent. An empty list still gets the ConfigMap
    (holding `{}`): the pods keep the mount, so adapters can be added later without a
    rollout."""
    if not serves_lora_adapters(spec):
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(llmd),
        "data": {LORA_FILE_KEY: lora_adapters_json(spec["runtime"]["loraAdapters"])},
    }
