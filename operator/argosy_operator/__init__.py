"""Argosy's Kubernetes operator: turns `LLMDeployment` resources into runtime pods.

Run it with `kopf run -A -m argosy_operator.handlers` or `argosy operator`. The package never
imports torch or the runtime's internals, so the operator image stays small.

Layout: `spec` (defaults and validation of the custom resource's spec), `model_source`
(`hf://`, `s3://`, `pvc://` and in-image paths), `builders/` (pure functions: spec in, child
manifests out), `merge_patch` (patches that touch only the fields the operator owns), `kube`
(a small asyncio Kubernetes API client), `workload` (read/patch the Deployment of an
LLMDeployment), `reconcile` (create/patch/delete children), `conditions` and `status`
(the status block), `handlers` (the thin kopf layer).
"""

from __future__ import annotations

from argosy_operator.constants import GROUP, KIND, PLURAL, VERSION

__all__ = ["GROUP", "VERSION", "PLURAL", "KIND"]
