"""spec.runtime.batchInvariant: the `--batch-invariant` flag, and the combinations the runtime
refuses at startup (GPUs, float32/float16) rejected at apply time by the
CRD's CEL rules and by `normalize_spec`."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from argosy_operator.builders import build_deployment
from argosy_operator.spec import normalize_spec
from crd_schema import cel_errors, openapi_schema, validate

BASE: dict[str, Any] = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                        "metadata": {"name": "x", "namespace": "ml"},
                        "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}
ADAPTERS = [{"name": "sql", "path": "/adapters/sql"}]

MESSAGES = {
    "dtype": "runtime.batchInvariant needs runtime.dtype auto or bfloat16",
    "gpus": "runtime.batchInvariant runs on CPUs only: resources.gpus must be 0",
}


def llmd(runtime: dict[str, Any] | None = None, resources: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    if runtime is not None:
        obj["spec"]["runtime"] = runtime
    if resources is not None:
        obj["spec"]["resources"] = resources
    return obj


def serve_args_of(spec: dict[str, Any]) -> list[str]:
    obj = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": spec}
    deployment = build_deployment(obj, normalize_spec(spec), replicas=1)
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_crd_field_is_a_boolean_defaulting_to_false() -> None:
    field = openapi_schema()["properties"]["spec"]["properties"]["runtime"]["properties"][
        "batchInvariant"]
    assert field["type"] == "boolean" and field["default"] is False
    assert "Batch-invariant mode" in field["description"]
    defaulted, errors = validate(llmd())
    assert errors == []
    assert defaulted["spec"]["runtime"]["batchInvariant"] is False
    assert normalize_spec({"model": {"name": "m", "path": "p"}})["runtime"][
        "batchInvariant"] is False


def test_true_adds_the_flag() -> None:
    args = serve_args_of({"model": {"name": "m", "path": "/models/m"},
                          "runtime": {"batchInvariant": True}})
    assert args.count("--batch-invariant") == 1
    assert "--no-batch-invariant" not in args
    # A derived flag: extraArgs still come last.
    args = serve_args_of({"model": {"name": "m", "path": "/models/m"},
                          "runtime": {"batchInvariant": True, "extraArgs": ["--seed", "7"]}})
    assert args.index("--batch-invariant") < args.index("--seed")


@pytest.mark.parametrize("runtime", [{"batchInvariant": False}, {}],
                         ids=["false", "absent"])
def test_false_or_absent_adds_no_flag(runtime: dict[str, Any]) -> None:
    defaulted, errors = validate(llmd(runtime=runtime))
    assert errors == []
    assert defaulted["spec"]["runtime"]["batchInvariant"] is False
    args = serve_args_of(defaulted["spec"])
    assert not any("batch-invariant" in a for a in args)


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("float32", llmd(runtime={"batchInvariant": True, "dtype": "float32"}), MESSAGES["dtype"]),
    ("float16", llmd(runtime={"batchInvariant": True, "dtype": "float16"}), MESSAGES["dtype"]),
    ("gpus", llmd(runtime={"batchInvariant": True}, resources={"gpus": 1}), MESSAGES["gpus"]),
]


@pytest.mark.parametrize("obj,message", [(o, m) for _, o, m in INVALID],
                         ids=[name for name, _, _ in INVALID])
def test_cel_rejects_what_the_runtime_refuses(obj: dict[str, Any], message: str) -> None:
    _, errors = validate(obj)
    assert errors, "accepted an invalid spec"
    assert [e for e in errors if message in e] != [], errors
    # Only the rule for this combination fires.
    assert all("batchInvariant" not in e or message in e for e in errors), errors


@pytest.mark.parametrize("obj,message", [(o, m) for _, o, m in INVALID],
                         ids=[name for name, _, _ in INVALID])
def test_normalize_spec_rejects_what_the_runtime_refuses(obj: dict[str, Any], message: str
                                                         ) -> None:
    # Same text as the CEL message, after the operator's "spec.<field>: " prefix.
    field, _, rest = message.partition(" ")
    with pytest.raises(ValueError) as raised:
        normalize_spec(obj["spec"])
    assert str(raised.value).startswith(f"spec.{field}: {rest}")


def test_the_rules_are_null_safe() -> None:
    """Evaluated with the fields they look at absent (as in objects stored before the fields
    had defaults): no rule errors out, and only the broken one fires."""
    def defaulted_without(obj: dict[str, Any], *paths: str) -> dict[str, Any]:
        out, errors = validate(obj)
        assert errors == []
        for path in paths:
            *parents, leaf = path.split(".")
            node = out["spec"]
            for key in parents:
                node = node[key]
            del node[leaf]
        return out

    ok = llmd(runtime={"batchInvariant": True})
    assert cel_errors(defaulted_without(ok, "resources", "runtime.dtype")) == []
    assert cel_errors(defaulted_without(ok, "resources.gpus")) == []
    assert cel_errors(defaulted_without(llmd(resources={"gpus": 2}),
                                        "runtime.batchInvariant")) == []
    obj = defaulted_without(ok, "resources")
    obj["spec"]["runtime"]["dtype"] = "float32"
    [error] = cel_errors(obj)
    assert error.startswith(f"spec.runtime: {MESSAGES['dtype']}")
    obj = defaulted_without(ok, "runtime.dtype")
    obj["spec"]["resources"]["gpus"] = 2
    assert cel_errors(obj) == [f"spec: {MESSAGES['gpus']}"]


@pytest.mark.parametrize("runtime,resources", [
    ({"batchInvariant": True}, None),
    ({"batchInvariant": True, "dtype": "auto"}, {"gpus": 0, "cpu": 4, "memory": "4Gi"}),
    ({"batchInvariant": True, "dtype": "bfloat16", "kvCacheDtype": "int8",
      "speculative": {"method": "ngram"}}, None),
    # The runtime serves LoRA adapters in this mode (lora_add's fused pass for every row
    # count), so the CRD must not refuse them.
    ({"batchInvariant": True, "loraAdapters": ADAPTERS}, None),
    # Likewise int8 and int4 weights (their kernels run every row count the same way there).
    ({"batchInvariant": True, "quantization": "int8"}, None),
    ({"batchInvariant": True, "quantization": "int4", "dtype": "bfloat16"}, None),
    # Off: every combination stays allowed.
    ({"batchInvariant": False, "dtype": "float32", "quantization": "int8",
      "loraAdapters": ADAPTERS}, {"gpus": 1}),
], ids=["cpu-defaults", "cpu-auto", "cpu-bfloat16", "cpu-lora", "cpu-int8", "cpu-int4",
        "off"])
def test_valid_combinations_are_accepted(runtime: dict[str, Any],
                                         resources: dict[str, Any] | None) -> None:
    defaulted, errors = validate(llmd(runtime=runtime, resources=resources))
    assert errors == []
    args = serve_args_of(defaulted["spec"])
    assert ("--batch-invariant" in args) == runtime["batchInvariant"]
    assert ("--lora-modules-file" in args) == ("loraAdapters" in runtime)
