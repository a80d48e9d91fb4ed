"""What is wrong with the runtime pods, in words a user can act on (for the Degraded condition).

The kubelet and the scheduler already say it, in pod status: waiting reasons of (init)
containers, the last termination, and the PodScheduled condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from argosy_operator.builders.download import DOWNLOAD_CONTAINER

IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                      "ErrImageNeverPull"}
CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError"}

# Most actionable first: a wrong image or too few GPUs explain every later symptom.
PRIORITY = ["ImagePullFailure", "Unschedulable", "ModelDownloadFailed", "ContainerConfigError",
            "OOMKilled", "CrashLoopBackOff"]


@dataclass(frozen=True)
class PodProblem:
    reason: str  # one of PRIORITY
    pod: str
    message: str


def _container_problem(pod: str, status: Mapping[str, Any], init: bool) -> PodProblem | None:
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    terminated = (status.get("state") or {}).get("terminated") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    reason = waiting.get("reason", "")
    detail = waiting.get("message", "")
    where = f"pod {pod} container {name}"
    if reason in IMAGE_PULL_REASONS:
        return PodProblem("ImagePullFailure", pod, f"{where}: {reason}: {detail}".rstrip(": "))
    if reason in CONFIG_REASONS:
        return PodProblem("ContainerConfigError", pod, f"{where}: {reason}: {detail}".rstrip(": "))
    if init and terminated and terminated.get("exitCode", 0) == 0:
        # Completed: a failed earlier attempt (lastState: a network blip, an OOM) was retried
        # and the download succeeded; the pod goes on, and lastState keeps that attempt for
        # the pod's lifetime, which reported Degraded on a healthy pod until it was replaced.
        return None
    failed = terminated if terminated.get("exitCode", 0) != 0 else last
    if init and name == DOWNLOAD_CONTAINER and (reason == "CrashLoopBackOff" or (
            failed and failed.get("exitCode", 0) != 0)):
        msg = failed.get("message") or failed.get("reason") or reason
        return PodProblem("ModelDownloadFailed", pod,
                          f"{where}: model download failed (exit {failed.get('exitCode', '?')})"
                          f": {msg}")
    # lastState keeps the kill for the pod's lifetime: once the restarted container is ready
    # again, it is history (the restart count says so), not a reason to stay Degraded.
    if terminated.get("reason") == "OOMKilled" or (
            last.get("reason") == "OOMKilled" and not status.get("ready")):
        return PodProblem("OOMKilled", pod, f"{where}: killed for exceeding its memory limit "
                          "(OOMKilled); raise spec.resources.memory or lower maxNumSeqs")
    if reason == "CrashLoopBackOff":
        exit_code = last.get("exitCode", "?")
        return PodProblem("CrashLoopBackOff", pod,
                          f"{where}: CrashLoopBackOff (last exit code {exit_code}): {detail}"
                          .rstrip(": "))
    return None


def pod_problems(pods: Iterable[Mapping[str, Any]]) -> list[PodProblem]:
    """Problems on the given pods, most actionable first (terminating pods are ignored)."""
    found: list[PodProblem] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                found.append(PodProblem("Unschedulable", name,
                                        f"pod {name}: {cond.get('message', 'unschedulable')}"))
        for key, init in (("initContainerStatuses", True), ("containerStatuses", False)):
            for cs in status.get(key) or []:
                problem = _container_problem(name, cs, init)
                if problem is not None:
                    found.append(problem)
    found.sort(key=lambda p: PRIORITY.index(p.reason))
    return found
