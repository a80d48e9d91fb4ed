"""Pure manifest builders: an LLMDeployment (and its normalized spec) in, child dicts out."""

from __future__ import annotations

from argosy_operator.builders.deployment import build_deployment
from argosy_operator.builders.lora_configmap import build_lora_configmap
from argosy_operator.builders.pdb import build_pdb
from argosy_operator.builders.service import build_service
from argosy_operator.builders.servicemonitor import build_servicemonitor

__all__ = ["build_deployment", "build_lora_configmap", "build_service", "build_pdb",
           "build_servicemonitor"]
