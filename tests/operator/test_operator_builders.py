"""Pure manifest builders: spec in, exact children out."""

from __future__ import annotations

import copy
import json
import pathlib
import re
from typing import Any

import pytest
import yaml
from argosy_operator.builders import (
    build_deployment,
    build_pdb,
    build_service,
    build_servicemonitor,
)
from argosy_operator.model_source import parse_model_source
from argosy_operator.spec import normalize_spec
from crd_schema import ROOT, validate

SAMPLES = ROOT / "manifests" / "samples"

LABELS = {"app.kubernetes.io/name": "argosy-runtime", "app.kubernetes.io/instance": "smollm2",
          "app.kubernetes.io/component": "llm-server",
          "app.kubernetes.io/managed-by": "argosy-operator",
          "argosy.dev/llmdeployment": "smollm2"}
OWNER = [{"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment", "name": "smollm2",
          "uid": "uid-1", "controller": True}]


def sample(path: pathlib.Path, name: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the LLMDeployment as the API server stores it, its normalized spec)."""
    obj, errors = validate(yaml.safe_load(path.read_text()))
    assert errors == []
    obj["metadata"].update(namespace="default", uid="uid-1")
    if name:
        obj["metadata"]["name"] = name
    return obj, normalize_spec(obj["spec"])


def test_cpu_sample_deployment_exact() -> None:
    llmd, spec = sample(SAMPLES / "cpu-smollm2.yaml")
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
             "timeoutSeconds": 5, "failureThreshold": 180}  # 1800 s of startup budget
    expected = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "smollm2", "namespace": "default", "labels": LABELS,
                     "ownerReferences": OWNER},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"argosy.dev/llmdeployment": "smollm2"}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": 2400,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": LABELS, "annotations": {
                    "kubectl.kubernetes.io/default-container": "runtime",
                    "prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                    "prometheus.io/path": "/metrics"}},
                "spec": {
                    "containers": [{
                        "name": "runtime",
                        "image": "ghcr.io/argosy-project/argosy-runtime-cpu:0.1.0",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["argosy"],
                        "args": ["serve", "--model", "smollm2-135m",
                                 "--served-model-name", "smollm2-135m",
                                 "--host", "0.0.0.0", "--port", "8000", "--dtype", "auto",
                                 "--kv-cache-dtype", "auto", "--max-model-len", "2048",
                                 "--max-num-seqs", "32", "--block-size", "16",
                                 "--enable-prefix-caching", "--drain-timeout", "30",
                                 "--batch-dir", "/tmp/argosy-batches"],
                        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                        "env": [{"name": "HOME", "value": "/tmp"},
                                {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
                                {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"}],
                        "resources": {"requests": {"cpu": "2", "memory": "2Gi"},
                                      "limits": {"memory": "2Gi"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        "startupProbe": probe,
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                           "periodSeconds": 5, "timeoutSeconds": 3,
                                           "failureThreshold": 2},
                        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                          "periodSeconds": 15, "timeoutSeconds": 5,
                                          "failureThreshold": 4},
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True,
                                            "capabilities": {"drop": ["ALL"]}},
                        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                    }],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "runAsGroup": 1000, "fsGroup": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 50,  # 5 preStop + 30 drain + 15
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                },
            },
        },
    }
    assert build_deployment(llmd, spec, replicas=1) == expected


def test_cpu_sample_service_servicemonitor_and_no_pdb() -> None:
    llmd, spec = sample(SAMPLES / "cpu-smollm2.yaml")
    meta = {"name": "smollm2", "namespace": "default", "labels": LABELS,
            "ownerReferences": OWNER}
    assert build_service(llmd, spec) == {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"type": "ClusterIP", "selector": {"argosy.dev/llmdeployment": "smollm2"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http",
                            "protocol": "TCP"}]}}
    assert build_servicemonitor(llmd, spec) == {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
        "spec": {"selector": {"matchLabels": {"argosy.dev/llmdeployment": "smollm2"}},
                 "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}
    assert build_pdb(llmd, spec) is None  # one replica


def test_gpu_sample_deployment() -> None:
    llmd, spec = sample(SAMPLES / "gpu-llama-3.1-8b-int4.yaml")
    dep = build_deployment(llmd, spec, replicas=None)
    assert "replicas" not in dep["spec"]  # the autoscaler owns it
    pod = dep["spec"]["template"]["spec"]
    (runtime,) = pod["containers"]
    assert runtime["image"] == "ghcr.io/argosy-project/argosy-runtime-cuda:0.1.0"
    assert runtime["args"] == [
        "serve", "--model", "/models/model",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16",
        "--quantization", "int4", "--kv-cache-dtype", "int8", "--max-model-len", "8192",
        "--max-num-seqs", "128", "--block-size", "16", "--enable-prefix-caching",
        "--speculative", '{"method":"ngram","num_speculative_tokens":4}',
        "--tool-call-parser", "llama3_json", "--drain-timeout", "60",
        "--batch-dir", "/tmp/argosy-batches"]
    assert runtime["resources"] == {
        # ephemeral-storage: the model emptyDir's sizeLimit, so the scheduler finds the disk
        "requests": {"cpu": "4", "memory": "32Gi", "ephemeral-storage": "40Gi",
                     "nvidia.com/gpu": "1"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}
    assert runtime["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model", "mountPath": "/models", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"] == [
        {"name": "tmp", "emptyDir": {}},
        {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]
    (init,) = pod["initContainers"]
    assert init["name"] == "model-download"
    assert init["image"] == runtime["image"]
    # A ResourceQuota on memory refuses a pod whose init container sets none: it takes the
    # runtime's CPU and memory (not its GPUs, not the emptyDir's disk).
    main = pod["containers"][0]["resources"]
    assert init["resources"] == {
        "requests": {"cpu": main["requests"]["cpu"], "memory": main["requests"]["memory"]},
        "limits": {"memory": main["limits"]["memory"]}}
    assert init["command"][:2] == ["python3", "-c"]
    assert init["command"][3:] == ["meta-llama/Llama-3.1-8B-Instruct", "main", "",
                                   "/models/model"]
    assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert init["volumeMounts"][0] == {"name": "model", "mountPath": "/models"}
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["terminationGracePeriodSeconds"] == 5 + 60 + 15
    pdb = build_pdb(llmd, spec)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1  # up to 4 replicas


def _llmd(**spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    base = {"model": {"name": "m", "path": "/models/m"}}
    base.update(spec)
    llmd = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": base}
    return llmd, normalize_spec(base)


def _pod(**spec: Any) -> dict[str, Any]:
    llmd, norm = _llmd(**spec)
    return build_deployment(llmd, norm, replicas=1)["spec"]["template"]["spec"]


def test_a_batch_volume_claim_is_shared_read_write_under_the_deployments_folder() -> None:
    pod = _pod(runtime={"batchVolumeClaim": "batch-store"})
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "batch-store"}} in \
        pod["volumes"]
    runtime = pod["containers"][0]
    assert {"name": "batches", "mountPath": "/var/lib/argosy/batches"} in runtime["volumeMounts"]
    # One claim may serve several LLMDeployments: each gets its own folder (this one is "x").
    assert runtime["args"][runtime["args"].index("--batch-dir") + 1] == \
        "/var/lib/argosy/batches/x"
    # Without the claim: the pod's own /tmp, and no such volume.
    pod = _pod()
    assert all(v["name"] != "batches" for v in pod["volumes"])
    args = pod["containers"][0]["args"]
    assert args[args.index("--batch-dir") + 1] == "/tmp/argosy-batches"


def test_pvc_source_is_mounted_read_only_without_download() -> None:
    pod = _pod(model={"name": "m", "source": "pvc://weights/llama/8b"})
    assert "initContainers" not in pod
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights",
                                                       "readOnly": True}} in pod["volumes"]
    runtime = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models/pvc", "readOnly": True} in \
        runtime["volumeMounts"]
    assert runtime["args"][runtime["args"].index("--model") + 1] == "/models/pvc/llama/8b"


@pytest.mark.parametrize("source,fmt,command,model_arg", [
    ("s3://bucket/llama/model.Q4_K_M.gguf", "auto",
     ["aws", "s3", "cp", "--only-show-errors", "s3://bucket/llama/model.Q4_K_M.gguf",
      "/models/model/model.Q4_K_M.gguf"], "/models/model/model.Q4_K_M.gguf"),
    ("s3://bucket/llama", "auto",
     ["aws", "s3", "sync", "--only-show-errors", "s3://bucket/llama/", "/models/model"],
     "/models/model"),
    ("s3://bucket/llama/", "hf",
     ["aws", "s3", "sync", "--only-show-errors", "s3://bucket/llama/", "/models/model"],
     "/models/model"),
])
def test_s3_sources(source: str, fmt: str, command: list[str], model_arg: str) -> None:
    pod = _pod(model={"name": "m", "source": source, "format": fmt,
                      "credentialsSecret": "s3"})
    (init,) = pod["initContainers"]
    assert init["image"] == "amazon/aws-cli:2.17.0"
    assert init["command"] == command
    assert {"name": "HOME", "value": "/tmp"} in init["env"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == model_arg


def test_hf_gguf_file_downloads_only_that_file() -> None:
    pod = _pod(model={"name": "m", "source": "hf://org/repo/sub/model.gguf", "format": "gguf",
                      "revision": "v1.0"})
    init = pod["initContainers"][0]
    assert init["command"][3:] == ["org/repo", "v1.0", "sub/model.gguf", "/models/model"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/model/sub/model.gguf"
    assert "envFrom" not in init


def test_serve_flags_edge_cases() -> None:
    pod = _pod(runtime={"prefixCaching": False, "maxWaiting": 64, "extraArgs": ["--seed", "7"],
                        "toolCallParser": "hermes",
                        "speculative": {"method": "draft", "draftModel": "/models/draft",
                                        "numSpeculativeTokens": 3},
                        "preStopSleepSeconds": 0, "drainTimeoutSeconds": 0})
    runtime = pod["containers"][0]
    args = runtime["args"]
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert "--quantization" not in args and "--max-model-len" not in args
    assert args[args.index("--max-waiting") + 1] == "64"
    assert args[args.index("--tool-call-parser") + 1] == "hermes"
    assert "--tool-call-parser" not in _pod()["containers"][0]["args"]
    assert json.loads(args[args.index("--speculative") + 1]) == {
        "method": "draft", "model": "/models/draft", "num_speculative_tokens": 3}
    assert args[-2:] == ["--seed", "7"]  # extra args come last, so they win
    assert "lifecycle" not in runtime  # no preStop pause asked for
    assert pod["terminationGracePeriodSeconds"] == 15


def test_lora_adapters_become_a_lora_modules_file() -> None:
    adapters = [{"name": "sql", "path": "/adapters/sql"}, {"name": "chat,v2", "path": "/a/c"}]
    args = _pod(runtime={"loraAdapters": adapters})["containers"][0]["args"]
    # The list itself is in the LoRA ConfigMap (test_operator_lora_adapters.py), not the args.
    assert args[args.index("--lora-modules-file") + 1] == "/etc/argosy/lora/adapters.json"
    assert "--lora-modules" not in args
    assert not any("/adapters/sql" in a for a in args)
    assert not any(a.startswith("--lora-modules") for a in _pod()["containers"][0]["args"])


def test_pod_template_overrides() -> None:
    llmd, spec = _llmd(
        podTemplate={"labels": {"team": "a", "argosy.dev/llmdeployment": "hijack"},
                     "annotations": {"prometheus.io/scrape": "false"},
                     "serviceAccountName": "reader", "imagePullSecrets": ["regcred"],
                     "volumes": [{"name": "cfg", "configMap": {"name": "c"}}],
                     "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]},
        runtime={"env": [{"name": "HOME", "value": "/home/x"}], "image": "my/img:1"},
        resources={"gpus": 2, "gpuResourceName": "amd.com/gpu", "runtimeClassName": "rocm",
                   "priorityClassName": "high", "nodeSelector": {"pool": "gpu"},
                   "tolerations": [{"key": "amd.com/gpu", "operator": "Exists"}],
                   "affinity": {"nodeAffinity": {}}})
    dep = build_deployment(llmd, spec, replicas=3)
    template = dep["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"]["argosy.dev/llmdeployment"] == "x"  # selector kept
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "false"
    assert pod["serviceAccountName"] == "reader"
    assert pod["automountServiceAccountToken"] is True
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["volumes"][-1] == {"name": "cfg", "configMap": {"name": "c"}}
    runtime = pod["containers"][0]
    assert runtime["volumeMounts"][-1] == {"name": "cfg", "mountPath": "/etc/cfg"}
    assert runtime["image"] == "my/img:1"
    assert [e for e in runtime["env"] if e["name"] == "HOME"] == [
        {"name": "HOME", "value": "/home/x"}]
    assert runtime["resources"]["limits"]["amd.com/gpu"] == "2"
    assert pod["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists"}]  # not doubled
    assert (pod["runtimeClassName"], pod["priorityClassName"]) == ("rocm", "high")
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["affinity"] == {"nodeAffinity": {}}
    assert dep["spec"]["replicas"] == 3


def _serve_args(**spec_fields) -> list[str]:  # noqa: ANN003
    return build_deployment(*_llmd(**spec_fields), replicas=1)["spec"]["template"]["spec"][
        "containers"][0]["args"]


def test_a_pod_with_several_gpus_runs_one_tensor_parallel_engine() -> None:
    assert "--tensor-parallel-size" not in _serve_args(resources={"gpus": 1})
    assert "--tensor-parallel-size" not in _serve_args()
    args = _serve_args(resources={"gpus": 4})
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    from argosy_runtime.cli.main import build_parser

    assert build_parser().parse_args(args).tensor_parallel_size == 4
    # extraArgs come after it, and the runtime's parser keeps the last value given
    args = _serve_args(resources={"gpus": 4}, runtime={"extraArgs": ["--tensor-parallel-size", "2"]})
    assert build_parser().parse_args(args).tensor_parallel_size == 2


@pytest.mark.parametrize("rollout", [{"maxSurge": "2", "maxUnavailable": "0"},
                                     {"maxSurge": "25%", "maxUnavailable": 1}])
def test_rollout_counts_written_as_strings_make_a_deployment_the_api_server_accepts(
        rollout: dict[str, Any]) -> None:
    llmd = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "x", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"name": "m", "path": "/models/m"}, "rollout": rollout}}
    obj, errors = validate(llmd)
    assert errors == []  # the CRD admits a count as a string, as it admits "25%"
    dep = build_deployment(obj, normalize_spec(obj["spec"]), replicas=1)
    rolling = dep["spec"]["strategy"]["rollingUpdate"]
    for key, written in rollout.items():
        # apps/v1 (ValidatePositiveIntOrPercent): an integer, or a string only as "N%"; a
        # "2" there was refused on every reconcile.
        assert isinstance(rolling[key], int) or re.fullmatch(r"[0-9]+%", rolling[key])
        assert str(rolling[key]) == str(written)


def test_pdb_follows_the_replica_ceiling() -> None:
    assert build_pdb(*_llmd(replicas=1)) is None
    assert build_pdb(*_llmd(replicas=2)) is not None
    assert build_pdb(*_llmd(replicas=5, autoscaling={"enabled": True, "maxReplicas": 1})) is None
    assert build_pdb(*_llmd(replicas=1, autoscaling={"enabled": True, "maxReplicas": 3})) \
        is not None


def test_servicemonitor_extra_labels() -> None:
    llmd, spec = _llmd(monitoring={"labels": {"release": "prometheus",
                                              "app.kubernetes.io/managed-by": "helm"}})
    labels = build_servicemonitor(llmd, spec)["metadata"]["labels"]
    assert labels["release"] == "prometheus"
    assert labels["app.kubernetes.io/managed-by"] == "argosy-operator"


def test_servicemonitor_can_be_switched_off_and_service_options() -> None:
    llmd, spec = _llmd(monitoring={"serviceMonitor": False},
                       service={"port": 80, "type": "LoadBalancer",
                                "annotations": {"lb/internal": "true"}})
    assert build_servicemonitor(llmd, spec) is None
    svc = build_service(llmd, spec)
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http",
                                     "protocol": "TCP"}]
    assert svc["metadata"]["annotations"] == {"lb/internal": "true"}


@pytest.mark.parametrize("source,message", [
    ("gs://bucket/key", "spec.model.source"),
    ("hf://just-a-name", "spec.model.source"),
    ("pvc://claim/../etc", "must not contain '..'"),
    ("s3://B/key", "spec.model.source"),
])
def test_bad_sources_raise_naming_the_field(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("'", "'")):
        parse_model_source(source, None)


@pytest.mark.parametrize("spec,field", [
    ({"model": {"name": "m"}}, "spec.model"),
    ({"model": {"path": "p"}}, "spec.model.name"),
    ({"model": {"name": "m", "path": "p"}, "runtime": {"quantization": "int4",
                                                        "dtype": "float32"}},
     "spec.runtime.quantization"),
    ({"model": {"name": "m", "path": "p"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas"),
    ({"model": {"name": "m", "path": "p"}, "runtime": {"speculative": {"method": "draft"}}},
     "spec.runtime.speculative.draftModel"),
    ({"model": {"name": "m", "path": "p"}, "rollout": {"progressDeadlineSeconds": 600}},
     "spec.rollout.progressDeadlineSeconds"),
    ({"model": {"name": "m", "path": "p"}, "runtime": {"loraAdapters": [
        {"name": "m", "path": "/a"}]}}, "spec.runtime.loraAdapters"),
])
def test_normalize_spec_rejects_unbuildable_specs(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        normalize_spec(spec)


def test_normalize_spec_does_not_mutate_its_input() -> None:
    spec = {"model": {"name": "m", "path": "p"}, "runtime": {"env": []}}
    before = copy.deepcopy(spec)
    normalize_spec(spec)
    assert spec == before
