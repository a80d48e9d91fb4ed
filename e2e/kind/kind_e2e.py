#!/usr/bin/env python3
"""Argosy end to end on a kind cluster: images, CRD, operator, a CPU LLMDeployment, autoscaling.

`make e2e-kind` (or `python e2e/kind/kind_e2e.py`) runs the whole scenario:

1. create the kind cluster from e2e/kind/kind-config.yaml (reused if it exists);
2. build the CPU runtime and operator images (docker/*.Dockerfile) and load them into kind;
3. install the CRD and the operator (`kubectl apply -k manifests/operator`), wait for rollout;
4. apply the CPU sample LLMDeployment from manifests/samples/ (with e2e settings: the local
   image, small requests, an eager autoscaling policy) and wait for its `Ready` condition;
5. port-forward its Service and send completions with the `openai` client;
6. drive load until the autoscaler adds a replica, and wait for it to become ready;
7. delete the LLMDeployment and check that none of its children remain;
8. delete the cluster (unless --keep-cluster).

tests/e2e/test_kind.py runs the same steps as a pytest module. Needs docker (with a running
engine), kind and kubectl on PATH; `preflight()` says what is missing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KIND_CONFIG = REPO / "e2e" / "kind" / "kind-config.yaml"
CRD_FILE = REPO / "crds" / "llmdeployments.argosy.dev.yaml"
OPERATOR_KUSTOMIZATION = REPO / "manifests" / "operator"
SAMPLES_DIR = REPO / "manifests" / "samples"

REGISTRY = "ghcr.io/argosy-project"
VERSION = "0.1.0"
# image short name -> Dockerfile; the suite needs only these two (no GPU, no gateway).
E2E_IMAGES = {"runtime-cpu": "docker/runtime-cpu.Dockerfile", "operator": "docker/operator.Dockerfile"}
E2E_NAMESPACE = "argosy-e2e"
CRD_NAME = "llmdeployments.argosy.dev"

# Kinds an LLMDeployment may own, directly or through them (ReplicaSets own the Pods).
CHILD_KINDS = "deployments,replicasets,pods,services,poddisruptionbudgets,configmaps"
_FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+) ->")


def image_ref(short_name: str) -> str:
    """Full image reference, e.g. ghcr.io/argosy-project/argosy-operator:0.1.0."""
    return f"{REGISTRY}/argosy-{short_name}:{VERSION}"


def log(message: str) -> None:
    print(f"[kind-e2e {time.strftime('%H:%M:%S')}] {message}", flush=True)


def preflight() -> str | None:
    """None when docker (with a reachable engine), kind and kubectl are usable, else why not."""
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (the kind suite needs docker, kind and kubectl)"
    probe = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0 or not probe.stdout.strip():
        detail = (probe.stderr.strip().splitlines() or ["no server version"])[-1]
        return f"no Docker engine reachable (docker info: {detail})"
    return None


def run(cmd: list[str], *, stdin: str | None = None, timeout: float = 600, check: bool = True) -> str:
    """Run a command, echoing it; return stdout; raise with stderr on failure."""
    log("$ " + " ".join(cmd))
    proc = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{cmd[0]} exited {proc.returncode}: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc.stdout


# --- pure helpers (unit-tested without a cluster) -------------------------------------------


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find_cpu_sample(samples_dir: Path = SAMPLES_DIR) -> dict[str, Any]:
    """The sample LLMDeployment that needs no GPU (the one the kind suite deploys)."""
    candidates: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(samples_dir.glob("*.y*ml")):
        for doc in load_yaml_documents(path):
            if doc.get("kind") != "LLMDeployment":
                continue
            gpus = (doc.get("spec", {}).get("resources") or {}).get("gpus", 0) or 0
            if gpus == 0:
                candidates.append((path, doc))
    if not candidates:
        raise ValueError(f"samples: no LLMDeployment without GPUs under {samples_dir}")
    # Prefer a file that says it is the CPU sample, if there are several.
    candidates.sort(key=lambda item: "cpu" not in item[0].name)
    return candidates[0][1]


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `overrides` merged in (dicts recursively, anything else replaced)."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# What the suite changes in the CPU sample: the image it just loaded into kind, requests small
# enough for two replicas on one CI runner, and an autoscaling policy that reacts within a minute
# to a queue (two sequences per replica, so a handful of concurrent requests queue up).
# A 256 MiB KV cache (the CPU default is 2 GiB) keeps each pod within its 2 GiB request.
E2E_SPEC_OVERRIDES: dict[str, Any] = {
    "runtime": {
        "image": image_ref("runtime-cpu"),
        "maxNumSeqs": 2,
        "extraArgs": ["--kv-cache-memory", str(256 * 1024 * 1024)],
    },
    "resources": {"cpu": "500m", "memory": "2Gi"},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetQueueDepth": 1,
        "stableWindowSeconds": 20,
        "scrapeIntervalSeconds": 2,
        "scaleUpStabilizationSeconds": 0,
    },
}


def e2e_deployment(sample: dict[str, Any], namespace: str = E2E_NAMESPACE) -> dict[str, Any]:
    """The LLMDeployment the suite applies: the sample, in `namespace`, with E2E_SPEC_OVERRIDES."""
    resource = deep_merge(sample, {"spec": E2E_SPEC_OVERRIDES})
    metadata = resource.setdefault("metadata", {})
    metadata["namespace"] = namespace
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
        metadata.pop(key, None)
    resource.pop("status", None)
    return resource


def served_model_name(resource: dict[str, Any]) -> str:
    """The model name clients send: spec.model.name, else the resource's name."""
    model = resource.get("spec", {}).get("model")
    if isinstance(model, dict) and model.get("name"):
        return str(model["name"])
    return str(resource["metadata"]["name"])


def owned_by(objects: list[dict[str, Any]], owner_uids: set[str]) -> list[dict[str, Any]]:
    """Objects whose ownerReferences chain leads to one of `owner_uids` (any depth in the list)."""
    uids = set(owner_uids)
    owned: list[dict[str, Any]] = []
    remaining = list(objects)
    changed = True
    while changed:  # Deployment -> ReplicaSet -> Pod: grow the owner set until it is closed
        changed = False
        for obj in list(remaining):
            refs = obj.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") in uids for ref in refs):
                owned.append(obj)
                remaining.remove(obj)
                uids.add(obj["metadata"].get("uid", ""))
                changed = True
    return owned


def parse_forwarded_port(line: str) -> int | None:
    """The local port from a `kubectl port-forward` output line, or None for other lines."""
    match = _FORWARDING.search(line)
    return int(match.group(1)) if match else None


def kind_node_version(config_path: Path = KIND_CONFIG) -> str:
    """Kubernetes major.minor of the kind node image, e.g. "1.33"."""
    config = yaml.safe_load(config_path.read_text())
    image = config["nodes"][0]["image"]
    match = re.search(r":v(\d+)\.(\d+)\.\d+", image)
    if match is None:
        raise ValueError(f"nodes[0].image: no vX.Y.Z tag in {image!r}")
    return f"{match.group(1)}.{match.group(2)}"


# --- cluster steps ----------------------------------------------------------------------------


@dataclass
class KindCluster:
    """A kind cluster and kubectl bound to its context."""

    name: str = "argosy-e2e"

    @property
    def context(self) -> str:
        return f"kind-{self.name}"

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 600,
                check: bool = True) -> str:
        return run(["kubectl", "--context", self.context, *args], stdin=stdin,
                   timeout=timeout, check=check)

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def create(self) -> None:
        existing = run(["kind", "get", "clusters"]).split()
        if self.name in existing:
            log(f"reusing kind cluster {self.name}")
            return
        run(["kind", "create", "cluster", "--name", self.name, "--config", str(KIND_CONFIG),
             "--wait", "180s"], timeout=900)

    def delete(self) -> None:
        run(["kind", "delete", "cluster", "--name", self.name], timeout=300, check=False)

    def build_and_load_images(self) -> None:
        revision = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False).strip()
        for short_name, dockerfile in E2E_IMAGES.items():
            run(["docker", "build", "-f", str(REPO / dockerfile), "-t", image_ref(short_name),
                 "--build-arg", f"REVISION={revision or 'unknown'}", str(REPO)], timeout=1800)
            run(["kind", "load", "docker-image", image_ref(short_name), "--name", self.name],
                timeout=900)

    def install_operator(self) -> None:
        """The CRD (crds/, which manifests/operator includes) and the operator; waits for both."""
        rendered = run(["kubectl", "kustomize", str(OPERATOR_KUSTOMIZATION)])
        if CRD_NAME not in rendered:  # the kustomization stopped including the CRD
            self.kubectl("apply", "-f", str(CRD_FILE))
        self.kubectl("apply", "-k", str(OPERATOR_KUSTOMIZATION))
        self.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        for obj in yaml.safe_load_all(rendered):
            if obj and obj.get("kind") == "Deployment":
                meta = obj["metadata"]
                self.kubectl("rollout", "status", f"deployment/{meta['name']}",
                             "-n", meta.get("namespace", "default"), "--timeout=300s")

    def apply(self, resource: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(resource))

    def ensure_namespace(self, namespace: str) -> None:
        manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        self.apply(manifest)

    def diagnostics(self, namespace: str) -> str:
        """Everything worth reading when a step failed (never raises)."""
        parts = []
        for args in (["get", "llmd,all,pdb,events", "-n", namespace, "-o", "wide"],
                     ["describe", "llmd", "-n", namespace],
                     ["get", "pods", "-A", "-o", "wide"],
                     ["logs", "-A", "-l", "app.kubernetes.io/name=argosy-operator", "--tail=200"]):
            try:
                parts.append(self.kubectl(*args, timeout=60, check=False))
            except Exception as exc:  # noqa: BLE001 - diagnostics must not mask the failure
                parts.append(f"kubectl {' '.join(args)}: {exc}")
        return "\n".join(parts)


@dataclass
class Deployed:
    """The LLMDeployment under test, as the cluster reports it."""

    name: str
    namespace: str
    uid: str
    model: str


def deploy_sample(cluster: KindCluster, namespace: str = E2E_NAMESPACE,
                  ready_timeout_s: int = 600) -> Deployed:
    """Apply the e2e variant of the CPU sample and wait for its Ready condition."""
    resource = e2e_deployment(find_cpu_sample(), namespace)
    cluster.ensure_namespace(namespace)
    cluster.apply(resource)
    name = resource["metadata"]["name"]
    cluster.kubectl("wait", "--for=condition=Ready", f"llmd/{name}", "-n", namespace,
                    f"--timeout={ready_timeout_s}s", timeout=ready_timeout_s + 30)
    live = cluster.get_json("llmd", name, "-n", namespace)
    return Deployed(name, namespace, live["metadata"]["uid"], served_model_name(resource))


def children(cluster: KindCluster, deployed: Deployed) -> list[dict[str, Any]]:
    """Objects in the namespace owned (directly or transitively) by the LLMDeployment."""
    items = cluster.get_json(CHILD_KINDS, "-n", deployed.namespace).get("items", [])
    return owned_by(items, {deployed.uid})


def owned_deployment(cluster: KindCluster, deployed: Deployed) -> dict[str, Any]:
    deployments = [o for o in children(cluster, deployed) if o["kind"] == "Deployment"]
    if len(deployments) != 1:
        raise AssertionError(f"expected one owned Deployment, found {len(deployments)}")
    return deployments[0]


def owned_service(cluster: KindCluster, deployed: Deployed) -> tuple[str, int]:
    services = [o for o in children(cluster, deployed) if o["kind"] == "Service"]
    if not services:
        raise AssertionError(f"LLMDeployment {deployed.name} owns no Service")
    service = services[0]
    return service["metadata"]["name"], int(service["spec"]["ports"][0]["port"])


@contextmanager
def port_forward(cluster: KindCluster, namespace: str, service: str, port: int,
                 timeout_s: float = 60) -> Iterator[str]:
    """`kubectl port-forward svc/...` on a free loopback port; yields the base URL."""
    cmd = ["kubectl", "--context", cluster.context, "port-forward", "-n", namespace,
           "--address", "127.0.0.1", f"svc/{service}", f":{port}"]
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        local_port = None
        assert proc.stdout is not None
        while local_port is None:
            line = proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"port-forward to svc/{service} did not start: {line!r}")
            local_port = parse_forwarded_port(line)
        # Keep draining kubectl's output so its pipe never fills and blocks it.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield f"http://127.0.0.1:{local_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def check_completions(base_url: str, model: str) -> list[str]:
    """Completions and a chat completion through the Service; returns the completion texts."""
    import openai  # the client users run; imported here so --help needs no openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="e2e", timeout=120, max_retries=2)
    listed = [m.id for m in client.models.list().data]
    if model not in listed:
        raise AssertionError(f"/v1/models lists {listed}, not {model!r}")
    texts = []
    for prompt in ("The capital of France is", "Write one word about the sea:"):
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                               temperature=0)
        choice = completion.choices[0]
        if not choice.text or completion.usage is None or completion.usage.completion_tokens < 1:
            raise AssertionError(f"empty completion for {prompt!r}: {completion}")
        texts.append(choice.text)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16
    )
    if not chat.choices[0].message.content:
        raise AssertionError(f"empty chat completion: {chat}")
    return texts


def drive_load_until(base_url: str, model: str, done: Callable[[], bool], *,
                     concurrency: int = 8, timeout_s: float = 600,
                     poll_s: float = 5) -> bool:
    """Keep `concurrency` long completions in flight until `done()` is true or time runs out."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="e2e", timeout=300, max_retries=0)
    stop = threading.Event()
    errors: list[str] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=model, prompt="Tell a long story about ships.",
                                          max_tokens=128, extra_body={"ignore_eos": True})
            except Exception as exc:  # noqa: BLE001 - a busy replica may shed load; keep going
                errors.append(repr(exc))
                time.sleep(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(poll_s)
        return False
    finally:
        stop.set()
        log(f"load stopped ({len(errors)} request errors)")


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 3) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def autoscale_up(cluster: KindCluster, deployed: Deployed, base_url: str) -> int:
    """Drive load until the owned Deployment wants 2+ replicas and 2 are ready; returns replicas."""

    def scaled() -> bool:
        return int(owned_deployment(cluster, deployed)["spec"].get("replicas", 1)) >= 2

    if not drive_load_until(base_url, deployed.model, scaled):
        raise AssertionError("the autoscaler did not add a replica under sustained load")
    if not wait_until(
        lambda: int(owned_deployment(cluster, deployed).get("status", {})
                    .get("readyReplicas", 0) or 0) >= 2, timeout_s=300):
        raise AssertionError("the added replica did not become ready")
    return int(owned_deployment(cluster, deployed)["spec"]["replicas"])


def delete_and_check_nothing_left(cluster: KindCluster, deployed: Deployed,
                                  timeout_s: float = 180) -> None:
    """Delete the LLMDeployment; every child must be garbage-collected."""
    cluster.kubectl("delete", "llmd", deployed.name, "-n", deployed.namespace, "--wait=true",
                    "--timeout=120s", timeout=150)
    if not wait_until(lambda: not children(cluster, deployed), timeout_s):
        left = [f"{o['kind']}/{o['metadata']['name']}" for o in children(cluster, deployed)]
        raise AssertionError(f"children left after deleting {deployed.name}: {left}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-name", default=os.environ.get("ARGOSY_KIND_CLUSTER",
                                                                 "argosy-e2e"))
    parser.add_argument("--keep-cluster", action="store_true",
                        help="leave the cluster running afterwards (to debug or rerun)")
    parser.add_argument("--skip-build", action="store_true",
                        help="do not build images; load the ones already tagged locally")
    args = parser.parse_args(argv)

    reason = preflight()
    if reason is not None:
        log(f"cannot run: {reason}")
        return 2
    cluster = KindCluster(args.cluster_name)
    cluster.create()
    try:
        if args.skip_build:
            for short_name in E2E_IMAGES:
                run(["kind", "load", "docker-image", image_ref(short_name), "--name",
                     cluster.name], timeout=900)
        else:
            cluster.build_and_load_images()
        cluster.install_operator()
        deployed = deploy_sample(cluster)
        log(f"LLMDeployment {deployed.namespace}/{deployed.name} is Ready")
        service, port = owned_service(cluster, deployed)
        with port_forward(cluster, deployed.namespace, service, port) as base_url:
            texts = check_completions(base_url, deployed.model)
            log(f"completions OK: {texts}")
            replicas = autoscale_up(cluster, deployed, base_url)
            log(f"autoscaler scaled the runtime to {replicas} replicas")
        delete_and_check_nothing_left(cluster, deployed)
        log("deleted; no children left. PASS")
        return 0
    except Exception:
        log("FAILED; cluster state follows")
        print(cluster.diagnostics(E2E_NAMESPACE), flush=True)
        raise
    finally:
        if not args.keep_cluster:
            cluster.delete()


if __name__ == "__main__":
    sys.exit(main())
