"""A spec change made while a failed reconcile waits for its retry is reconciled at once (the
real kopf operator against the emulated API server)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from operator_helpers import NS, Api, eventually, wait_for_degraded

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"

pytestmark = pytest.mark.timeout(120)


async def test_fixing_the_spec_does_not_wait_out_the_retry_delay(api: Api,
                                                                 run_operator: Any) -> None:
    """The user's own ConfigMap is named like the LLMDeployment, whose loraAdapters want that
    name: ChildConflict, retried after 10 s, then 20, 40, ... up to 5 minutes. Dropping
    loraAdapters from the spec resolves it; the operator must act on that change now, not
    when the retry delay of the earlier generation runs out."""
    await api.call("POST", CM_PATH, {"apiVersion": "v1", "kind": "ConfigMap",
                                     "metadata": {"name": "chat", "namespace": NS},
                                     "data": {"mine": "yes"}}, "application/json")
    body = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"model": {"name": "smollm2", "path": "smollm2-135m"},
                     "runtime": {"loraAdapters": []}}}
    with run_operator():
        await api.call("POST", LLMD_PATH, body, "application/json")
        await wait_for_degraded(api, "ChildConflict")
        assert await api.get_or_none(f"{DEP_PATH}/chat") is None
        await api.call("PATCH", f"{LLMD_PATH}/chat", {"spec": {"runtime": {
            "loraAdapters": None}}})
        fixed_at = time.monotonic()
        await eventually(lambda: api.get_or_none(f"{DEP_PATH}/chat"), 30, "the Deployment")
        waited = time.monotonic() - fixed_at
        assert waited < 4, f"the fixed spec was applied only after {waited:.1f} s"
        cond = await wait_for_degraded(api, "AsExpected")
        assert cond["status"] == "False"
    cm = await api.get_or_none(f"{CM_PATH}/chat")
    assert cm["data"] == {"mine": "yes"}  # the user's ConfigMap is left alone


def test_a_retry_record_holds_within_its_generation_only() -> None:
    """Without a spec change the backoff goes on (the record, tries counted, is kept); the
    next generation starts afresh."""
    import kopf
    from argosy_operator.handlers import KOPF_PREFIX, GenerationProgressStorage

    storage = GenerationProgressStorage(prefix=KOPF_PREFIX)
    body = kopf.Body({"metadata": {"name": "chat", "namespace": NS, "generation": 3}})
    patch = kopf.Patch()
    record = {"started": "2026-01-01T00:00:00.000000+00:00",
              "delayed": "2026-01-01T00:05:00.000000+00:00", "retries": 5}
    storage.store(key=kopf.HandlerId("reconcile_llmdeployment"), record=record, body=body,
                  patch=patch)
    annotations = dict(patch["metadata"]["annotations"])
    same = kopf.Body({"metadata": {"generation": 3, "annotations": annotations}})
    assert storage.fetch(key=kopf.HandlerId("reconcile_llmdeployment"), body=same) == record
    newer = kopf.Body({"metadata": {"generation": 4, "annotations": annotations}})
    assert storage.fetch(key=kopf.HandlerId("reconcile_llmdeployment"), body=newer) is None
