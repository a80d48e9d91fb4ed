"""The CRD's schema and CEL rules: samples pass, a table of invalid specs is rejected with a
useful message, and the operator's Python defaults match the CRD's defaults."""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import pytest
import yaml
from argosy_operator.spec import DEFAULTS, InvalidSpecError, normalize_spec
from crd_schema import ROOT, apply_defaults, load_crd, openapi_schema, validate

SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
BASE: dict[str, Any] = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                        "metadata": {"name": "x", "namespace": "ml"},
                        "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = obj["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj


_DELETE = object()


def with_name(name: str) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["metadata"]["name"] = name
    return obj


def test_crd_names_and_subresources() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "llmdeployments.argosy.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "LLMDeployment", "llmdeployments", ["llmd"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:6] == ["Model", "Replicas", "Ready", "KV-cache %", "Queue", "Age"]


def test_every_spec_field_has_a_description() -> None:
    missing = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            if "description" not in sub and path + key not in (".metadata",):
                missing.append(path + "." + key if path else key)
            walk(sub, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            walk(node["items"], path + "[]")

    walk(openapi_schema()["properties"]["spec"], "spec")
    assert missing == []


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_validate(path: pathlib.Path) -> None:
    obj = yaml.safe_load(path.read_text())
    defaulted, errors = validate(obj)
    assert errors == []
    # The operator can build children from the defaulted spec (no ValueError).
    normalize_spec(defaulted["spec"])


def test_defaults_fill_a_minimal_spec() -> None:
    defaulted, errors = validate(copy.deepcopy(BASE))
    assert errors == []
    spec = defaulted["spec"]
    assert spec["replicas"] == 1
    assert spec["runtime"]["maxNumSeqs"] == 256
    assert spec["autoscaling"]["enabled"] is False
    assert spec["autoscaling"]["scaleDownStabilizationSeconds"] == 300
    assert spec["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    assert spec["rollout"] == {"maxSurge": 1, "maxUnavailable": 0,
                               "progressDeadlineSeconds": 2400}


def test_python_defaults_match_the_crd() -> None:
    """spec.DEFAULTS (used when the API server has not defaulted an object) == the CRD's."""
    minimal = {"model": {"name": "m", "path": "p"}}
    from_crd = apply_defaults(openapi_schema()["properties"]["spec"], minimal)
    assert normalize_spec(minimal) == from_crd
    assert set(DEFAULTS) | {"model"} == set(from_crd)


def test_autoscaling_contract_fields() -> None:
    props = openapi_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    expected = {"enabled": False, "minReplicas": 1, "maxReplicas": 4,
                "targetKVCacheUtilization": 0.7, "targetQueueDepth": 4, "tolerance": 0.1,
                "stableWindowSeconds": 60, "panicWindowSeconds": 6, "panicThreshold": 2.0,
                "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300,
                "maxScaleUpRate": 2.0, "maxScaleDownRate": 0.5, "scrapeIntervalSeconds": 5,
                "scaleToZeroIdleSeconds": 600}
    assert {k: v["default"] for k, v in props.items()} == expected
    status = openapi_schema()["properties"]["status"]["properties"]
    for field in ("desiredReplicas", "lastScaleTime", "kvCacheUtilization", "kvCachePercent",
                  "queueDepth", "autoscaling", "conditions"):
        assert field in status
    assert status["autoscaling"]["x-kubernetes-preserve-unknown-fields"] is True


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no model source", with_spec(model__path=_DELETE),
     "set exactly one of model.source or model.path"),
    ("two model sources", with_spec(model__source="hf://org/name"),
     "set exactly one of model.source or model.path"),
    ("unknown source scheme", with_spec(model__path=_DELETE, model__source="gs://b/k"),
     "model.source: 'gs://b/k' does not match"),
    ("revision on a path", with_spec(model__revision="v2"),
     "model.revision applies only to hf:// sources"),
    ("credentials on a pvc", with_spec(model__path=_DELETE, model__source="pvc://weights/llama",
                                       model__credentialsSecret="s3-creds"),
     "model.credentialsSecret applies only to hf:// and s3:// sources"),
    ("gguf from hf without a file", with_spec(model__path=_DELETE, model__format="gguf",
                                              model__source="hf://org/name"),
     "format gguf with an hf:// source must name the .gguf file"),
    ("cache limit on a pvc", with_spec(model__path=_DELETE, model__source="pvc://w/m",
                                       model__cacheSizeLimit="10Gi"),
     "model.cacheSizeLimit applies only to downloaded"),
    ("int4 with float32", with_spec(runtime__quantization="int4", runtime__dtype="float32"),
     "int4 quantization needs dtype auto, float16 or bfloat16"),
    ("unknown quantization", with_spec(runtime__quantization="fp8"),
     "runtime.quantization: 'fp8' is not one of ['int8', 'int4']"),
    ("duplicate adapters", with_spec(runtime__loraAdapters=[{"name": "a", "path": "/l/a"},
                                                            {"name": "a", "path": "/l/b"}]),
     "runtime.loraAdapters names must be unique"),
    ("adapter named like the model", with_spec(runtime__loraAdapters=[
        {"name": "m", "path": "/l/a"}]),
     "a runtime.loraAdapters name must differ from model.name"),
    ("relative adapter path", with_spec(runtime__loraAdapters=[{"name": "a", "path": "l/a"}]),
     "does not match"),
    ("adapter repo without an org", with_spec(runtime__loraAdapters=[
        {"name": "a", "path": "hf://adapter"}]), "does not match"),
    ("adapter bucket without a prefix", with_spec(runtime__loraAdapters=[
        {"name": "a", "path": "s3://bucket"}]), "does not match"),
    ("adapter bucket with capitals", with_spec(runtime__loraAdapters=[
        {"name": "a", "path": "s3://Bucket/sql"}]), "does not match"),
    ("more adapters per step than loaded", with_spec(runtime__maxLoras=8,
                                                      runtime__maxLoadedLoras=4),
     "runtime.maxLoras must be <= runtime.maxLoadedLoras"),
    ("no adapters per step", with_spec(runtime__maxLoras=0),
     "runtime.maxLoras: 0 is less than the minimum of 1"),
    ("no adapters loaded", with_spec(runtime__maxLoadedLoras=0),
     "runtime.maxLoadedLoras: 0 is less than the minimum of 1"),
    ("draft without a model", with_spec(runtime__speculative={"method": "draft"}),
     "speculative.method draft needs speculative.draftModel"),
    ("draft model with ngram", with_spec(runtime__speculative={"draftModel": "/m/draft"}),
     "speculative.draftModel applies only to method draft"),
    ("min above max", with_spec(autoscaling={"enabled": True, "minReplicas": 5,
                                             "maxReplicas": 2}),
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ("max replicas above the cap of replicas", with_spec(autoscaling={"enabled": True,
                                                              "maxReplicas": 1001}),
     "autoscaling.maxReplicas: 1001 is greater than the maximum of 1000"),
    ("kv target above 1", with_spec(autoscaling__targetKVCacheUtilization=1.5),
     "autoscaling.targetKVCacheUtilization: 1.5 is greater than the maximum of 1"),
    ("kv target zero", with_spec(autoscaling__targetKVCacheUtilization=0),
     "autoscaling.targetKVCacheUtilization: 0 is less than or equal to the minimum of 0"),
    ("tolerance of 1", with_spec(autoscaling__tolerance=1),
     "autoscaling.tolerance: 1 is greater than or equal to the maximum of 1"),
    ("scale-down rate zero", with_spec(autoscaling__maxScaleDownRate=0),
     "autoscaling.maxScaleDownRate: 0 is less than or equal to the minimum of 0"),
    ("panic threshold below 1", with_spec(autoscaling__panicThreshold=0.5),
     "autoscaling.panicThreshold: 0.5 is less than the minimum of 1"),
    ("no rollout progress", with_spec(rollout={"maxSurge": "0%", "maxUnavailable": 0}),
     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0"),
    ("deadline shorter than loading", with_spec(runtime__startupTimeoutSeconds=3600),
     "rollout.progressDeadlineSeconds must exceed runtime.startupTimeoutSeconds"),
    ("negative replicas", with_spec(replicas=-1), "replicas: -1 is less than the minimum of 0"),
    ("bad memory quantity", with_spec(resources__memory="lots"),
     "resources.memory: 'lots' is not valid"),
    ("typo in a field", with_spec(runtime__maxNumSeq=8),
     "Additional properties are not allowed ('maxNumSeq' was unexpected)"),
    ("unknown service type", with_spec(service__type="ExternalName"),
     "service.type: 'ExternalName' is not one of"),
    ("block size not a power of two", with_spec(runtime__blockSize=12),
     "runtime.blockSize: 12 is not one of [8, 16, 32, 64]"),
    ("missing served name", with_spec(model__name=_DELETE), "'name' is a required property"),
    ("batch claim not a name", with_spec(runtime__batchVolumeClaim="Batch Store"),
     "runtime.batchVolumeClaim: 'Batch Store' does not match"),
    # Names Kubernetes admits for the object but not for its Service (a DNS-1035 label).
    ("a dot in the name", with_name("llama-3.1"), "metadata.name must be at most 63"),
    ("a name starting with a digit", with_name("7b-chat"), "metadata.name must be at most 63"),
    ("a 64-character name", with_name("a" * 64), "metadata.name must be at most 63"),
    # Durations the Prometheus Operator's ServiceMonitor refuses (units largest first, once).
    ("interval units out of order", with_spec(monitoring__interval="1s1m"),
     "monitoring.interval: '1s1m' does not match"),
    ("interval unit twice", with_spec(monitoring__interval="15s15s"),
     "monitoring.interval: '15s15s' does not match"),
    # Go's `$` is the end of the text: the API server refuses a trailing newline.
    ("interval with a trailing newline", with_spec(monitoring__interval="30s\n"),
     "monitoring.interval: '30s\\n' does not match"),
    ("flags the operator sets", with_spec(runtime__extraArgs=["--max-num-seqs", "8",
                                                              "--port=9000"]),
     "runtime.extraArgs must not set --host, --port"),
    ("the model flag", with_spec(runtime__extraArgs=["--model", "/elsewhere"]),
     "runtime.extraArgs must not set"),
]


@pytest.mark.parametrize("obj,message", [(o, m) for _, o, m in INVALID],
                         ids=[name for name, _, _ in INVALID])
def test_invalid_specs_are_rejected_with_a_useful_message(obj: dict[str, Any], message: str
                                                          ) -> None:
    _, errors = validate(obj)
    assert errors, "accepted an invalid spec"
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("changes", [
    {"model__path": _DELETE, "model__source": "hf://Qwen/Qwen2.5-0.5B-Instruct",
     "model__revision": "main", "model__credentialsSecret": "hf"},
    {"model__path": _DELETE, "model__source": "hf://org/repo/model.Q4_K_M.gguf",
     "model__format": "gguf"},
    {"model__path": _DELETE, "model__source": "s3://my-bucket/models/llama/"},
    {"model__path": _DELETE, "model__source": "pvc://weights"},
    {"runtime__quantization": "int4", "runtime__dtype": "auto"},
    {"runtime__speculative": {"method": "draft", "draftModel": "/models/draft"}},
    {"rollout": {"maxSurge": "25%", "maxUnavailable": "25%"}},
    {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1}},
    {"autoscaling": {"enabled": True, "minReplicas": 1000, "maxReplicas": 1000}},
    {"resources__memory": "512Mi", "resources__cpu": 2},
    {"runtime__batchVolumeClaim": "batch-store"},
    {"runtime__maxLoras": 4, "runtime__maxLoadedLoras": 4},
    {"monitoring__interval": "1m30s"}, {"monitoring__interval": "500ms"},
    {"runtime__extraArgs": ["--tensor-parallel-size", "2", "--max-model-len=4096",
                            "--portable-thing", "--model-impl"]},
    {"runtime__maxLoras": 4},
    {"runtime__maxLoadedLoras": 1},
    {"runtime__loraAdapters": [{"name": "sql", "path": "hf://org/sql-lora"},
                               {"name": "sql:v2", "path": "hf://org/sql-lora@v2.0"},
                               {"name": "chat", "path": "/adapters/chat"},
                               {"name": "s3", "path": "s3://my-adapters/sql/v3"},
                               {"name": "gcs", "path": "s3://team_adapters/sql"}]},
])
def test_valid_edge_cases_are_accepted(changes: dict[str, Any]) -> None:
    _, errors = validate(with_spec(**changes))
    assert errors == []


# The label and annotation maps the operator copies onto its children: keys are Kubernetes
# qualified names, label values at most 63 characters (or empty). The API server refuses the
# child that carries a bad one; the CRD refuses the LLMDeployment at `kubectl apply` instead.
_PREFIX_253 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
METADATA_MAPS = [("podTemplate", "labels"), ("monitoring", "labels"),
                 ("podTemplate", "annotations"), ("service", "annotations")]
GOOD_KEYS = ["team", "a", "A1", "a_b.c-d", "UPPER_case", "x" * 63, "example.com/tier",
             "app.kubernetes.io/name", "k8s.io/Mixed.Name_1", f"{_PREFIX_253}/{'n' * 63}"]
BAD_KEYS = ["", "not a key", "-lead", "trail-", "_x", "x" * 64, "Example.com/lb",
            "ex..com/x", "-ex.com/x", "a/b/c", "/name", "prefix/", "a/-b",
            f"{_PREFIX_253}e/n", "team\n", "héllo"]
GOOD_LABEL_VALUES = ["", "v", "v1.2_x", "x" * 63, "A-b_c.D"]
BAD_LABEL_VALUES = ["ml platform", "x" * 64, "prometheus/stack", "-a", "a-", ".a", "é"]


def _map_spec(parent: str, field: str, values: dict[str, str]) -> dict[str, Any]:
    return with_spec(**{f"{parent}__{field}": values})


@pytest.mark.parametrize("parent,field", METADATA_MAPS)
def test_metadata_map_keys_the_api_server_takes_are_accepted(parent: str, field: str) -> None:
    obj = _map_spec(parent, field, {key: "v" for key in GOOD_KEYS})
    assert validate(obj)[1] == []
    normalize_spec(obj["spec"])  # the operator's own check agrees


@pytest.mark.parametrize("parent,field", METADATA_MAPS)
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_metadata_map_keys_the_api_server_refuses_are_rejected(parent: str, field: str,
                                                               key: str) -> None:
    obj = _map_spec(parent, field, {"fine": "v", key: "v"})
    errors = validate(obj)[1]
    assert any(e.startswith(f"spec.{parent}.{field}: {parent}.{field} keys must be")
               for e in errors), errors
    # The operator refuses it too (an object applied under an older CRD).
    with pytest.raises(ValueError, match=rf"spec\.{parent}\.{field}"):
        normalize_spec(obj["spec"])


@pytest.mark.parametrize("parent", ["podTemplate", "monitoring"])
def test_label_values(parent: str) -> None:
    good = _map_spec(parent, "labels", {f"k{i}": v for i, v in enumerate(GOOD_LABEL_VALUES)})
    assert validate(good)[1] == []
    normalize_spec(good["spec"])
    for value in BAD_LABEL_VALUES:
        bad = _map_spec(parent, "labels", {"k": value})
        errors = validate(bad)[1]
        assert any(e.startswith(f"spec.{parent}.labels.k: ") for e in errors), (value, errors)
        with pytest.raises(ValueError, match=rf"spec\.{parent}\.labels\.k"):
            normalize_spec(bad["spec"])
    # A trailing newline: the API server's Go regexps refuse it ($ is the end of the text),
    # and so must the operator's Python ones ($ also matches before a final newline).
    with pytest.raises(ValueError, match=rf"spec\.{parent}\.labels\.k"):
        normalize_spec(_map_spec(parent, "labels", {"k": "v\n"})["spec"])


@pytest.mark.parametrize("parent", ["podTemplate", "service"])
def test_annotation_values_may_be_any_string(parent: str) -> None:
    obj = _map_spec(parent, "annotations", {"a": "", "b": "any text: with / symbols\n and é",
                                            "c": "x" * 10_000})
    assert validate(obj)[1] == []


@pytest.mark.parametrize("parent,field", METADATA_MAPS)
def test_metadata_maps_are_bounded(parent: str, field: str) -> None:
    # maxProperties keeps the key rule's estimated CEL cost within the API server's budget.
    assert validate(_map_spec(parent, field, {f"k{i}": "v" for i in range(256)}))[1] == []
    errors = validate(_map_spec(parent, field, {f"k{i}": "v" for i in range(257)}))[1]
    assert any("too many properties" in e for e in errors), errors


def _defaulted_fields(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """(dotted path under spec, schema) of every CRD field that has a default, nested ones
    included (runtime.speculative's, which apply when the object is given)."""
    found = []
    for key, prop in schema.get("properties", {}).items():
        field = f"{path}.{key}"
        if "default" in prop and prop.get("type") != "object":
            found.append((field, prop))
        found += _defaulted_fields(prop, field)
    return found


_WRONG = {"integer": "2", "number": "0.5", "boolean": "true", "string": 5, "array": "--x"}


@pytest.mark.parametrize(("field", "prop"), _defaulted_fields(
    openapi_schema()["properties"]["spec"], "spec"), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(field: str,
                                                               prop: dict[str, Any]) -> None:
    """What the CRD refuses for its type, an object written under an older CRD still holds:
    normalize_spec refuses it (InvalidSpec, reported on the object) naming the field. It
    was a TypeError inside a builder (`replicas: "2"`: '<' between str and int), retried
    forever with a traceback and never reported."""
    wrong = True if prop.get("x-kubernetes-int-or-string") else _WRONG[prop["type"]]
    obj = with_spec(**{field.removeprefix("spec.").replace(".", "__"): wrong})
    if field.startswith("spec.runtime.speculative."):
        obj["spec"]["runtime"]["speculative"].setdefault("method", "ngram")
    assert validate(obj)[1], "the CRD accepts it: not a wrong type"
    with pytest.raises(InvalidSpecError, match=rf"^{re.escape(field)}: must be "):
        normalize_spec(obj["spec"])


def test_values_the_crd_takes_for_a_type_are_not_refused() -> None:
    # an integer where a number is meant; a percentage where an int-or-string is
    obj = with_spec(autoscaling__tolerance=0, rollout__maxSurge="25%",
                    rollout__maxUnavailable=0)
    assert validate(obj)[1] == []
    normalize_spec(obj["spec"])
