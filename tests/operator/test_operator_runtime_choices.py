"""The optional runtime choices of spec.runtime, each one `argosy serve` flag with a fixed set
of values: `embeddingPooling` (--embedding-pooling), `toolCallParser` (--tool-call-parser),
`reasoningParser` (--reasoning-parser). Unset, the flag is left out and the runtime's own
default applies; the CRD's enum is exactly what the runtime's parser accepts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from argosy_operator.builders import build_deployment
from argosy_operator.spec import DEFAULTS, normalize_spec
from argosy_runtime.server.config import EMBEDDING_POOLINGS, REASONING_PARSERS, TOOL_CALL_PARSERS
from crd_schema import openapi_schema, validate
from operator_helpers import NS, Api, eventually, settle

BASE: dict[str, Any] = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                        "metadata": {"name": "x", "namespace": "ml"},
                        "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"


class Choice:
    """One field: its CRD name, the serve flag, the parsed attribute, the runtime's choices and
    the runtime's default when the flag is left out."""

    def __init__(self, field: str, flag: str, choices: tuple[str, ...], default: str | None
                 ) -> None:
        self.field, self.flag, self.choices, self.default = field, flag, choices, default
        self.attr = flag.removeprefix("--").replace("-", "_")

    def __repr__(self) -> str:
        return self.field


CHOICES = [Choice("embeddingPooling", "--embedding-pooling", EMBEDDING_POOLINGS, None),
           Choice("toolCallParser", "--tool-call-parser", TOOL_CALL_PARSERS, None),
           Choice("reasoningParser", "--reasoning-parser", REASONING_PARSERS, None)]
each_choice = pytest.mark.parametrize("choice", CHOICES, ids=repr)


def llmd(runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    if runtime is not None:
        obj["spec"]["runtime"] = runtime
    return obj


def serve_args_of(spec: dict[str, Any]) -> list[str]:
    obj = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": spec}
    deployment = build_deployment(obj, normalize_spec(spec), replicas=1)
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def runtime_server_args(args: list[str]) -> Any:
    """`args` (after `argosy`) through the runtime's own parser, as the container's
    `argosy serve` reads them (nothing is loaded)."""
    from argosy_runtime.cli.main import build_parser

    return build_parser().parse_args(args)


@each_choice
def test_the_crd_field_is_an_optional_enum_of_the_runtime_choices(choice: Choice) -> None:
    field = openapi_schema()["properties"]["spec"]["properties"]["runtime"]["properties"][
        choice.field]
    assert field["type"] == "string" and field["enum"] == list(choice.choices)
    assert "default" not in field  # unset: the runtime's own default applies
    assert choice.flag in field["description"]  # what kubectl explain shows
    assert choice.field not in DEFAULTS["runtime"]
    defaulted, errors = validate(llmd())
    assert errors == []
    assert choice.field not in defaulted["spec"]["runtime"]
    for value in choice.choices:
        defaulted, errors = validate(llmd(runtime={choice.field: value}))
        assert errors == []
        assert defaulted["spec"]["runtime"][choice.field] == value


@each_choice
@pytest.mark.parametrize("value", ["", "Mean", "QWEN3", "other", 1, True])
def test_the_crd_rejects_other_values(choice: Choice, value: Any) -> None:
    _, errors = validate(llmd(runtime={choice.field: value}))
    assert [e for e in errors if e.startswith(f"spec.runtime.{choice.field}:")] != [], errors


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@each_choice
def test_the_flag_is_passed_only_when_set(choice: Choice) -> None:
    model = {"name": "m", "path": "/models/m"}
    without = serve_args_of({"model": model})
    for runtime in ({}, {choice.field: None}):  # absent or null: the runtime's default
        args = serve_args_of({"model": model, "runtime": runtime})
        assert args == without and flag_values(args, choice.flag) == []
        assert getattr(runtime_server_args(args), choice.attr) == choice.default
    for value in choice.choices:
        args = serve_args_of({"model": model, "runtime": {choice.field: value}})
        assert flag_values(args, choice.flag) == [value]
        assert getattr(runtime_server_args(args), choice.attr) == value
        # Only the flag differs from the unset spec.
        i = args.index(choice.flag)
        assert args[:i] + args[i + 2:] == without


@each_choice
def test_extra_args_come_after_the_field_and_win(choice: Choice) -> None:
    """No deduplication: the field's flag first, extraArgs after, and argparse keeps the
    last, so the flag in extraArgs overrides the field (docs/operator.md)."""
    first, last = choice.choices[0], choice.choices[-1]
    args = serve_args_of({"model": {"name": "m", "path": "/models/m"},
                          "runtime": {choice.field: first, "extraArgs": [choice.flag, last]}})
    assert args[-2:] == [choice.flag, last]
    assert flag_values(args, choice.flag) == [first, last]
    assert getattr(runtime_server_args(args), choice.attr) == last


# --- the operator against the emulated API server --------------------------------------------

def _body(**runtime: Any) -> dict[str, Any]:
    return {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "emb", "namespace": NS},
            "spec": {"model": {"name": "smollm2", "path": "smollm2-135m"}, "replicas": 1,
                     "runtime": runtime}}


async def _observed(api: Api, generation: int) -> bool:
    obj = await api.get_or_none(f"{LLMD_PATH}/emb")
    return (obj or {}).get("status", {}).get("observedGeneration") == generation


def _pooling(dep: dict[str, Any]) -> str | None:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--embedding-pooling") + 1] if "--embedding-pooling" in args \
        else None


async def test_changing_the_field_rolls_the_pods(kube: Any, api: Api, run_operator: Any
                                                 ) -> None:
    """The flag is in the pod template's args, so setting, changing or removing the field
    patches the Deployment's template (a new ReplicaSet: the pods roll). Shown with
    embeddingPooling; the other fields are args the same way."""
    with run_operator():
        await api.call("POST", LLMD_PATH, _body(), "application/json")
        await eventually(lambda: _observed(api, 1), what="first reconcile")
        await settle(kube)
        unset = await api.get_or_none(f"{DEP_PATH}/emb")

        await api.call("PATCH", f"{LLMD_PATH}/emb",
                       {"spec": {"runtime": {"embeddingPooling": "mean"}}})
        await eventually(lambda: _observed(api, 2), what="field set")
        await settle(kube)
        mean = await api.get_or_none(f"{DEP_PATH}/emb")

        await api.call("PATCH", f"{LLMD_PATH}/emb",
                       {"spec": {"runtime": {"embeddingPooling": "last"}}})
        await eventually(lambda: _observed(api, 3), what="field changed")
        await settle(kube)
        last = await api.get_or_none(f"{DEP_PATH}/emb")

        await api.call("PATCH", f"{LLMD_PATH}/emb",
                       {"spec": {"runtime": {"embeddingPooling": None}}})
        await eventually(lambda: _observed(api, 4), what="field removed")
        await settle(kube)
        removed = await api.get_or_none(f"{DEP_PATH}/emb")

    assert [_pooling(d) for d in (unset, mean, last, removed)] == [None, "mean", "last", None]
    generations = [d["metadata"]["generation"] for d in (unset, mean, last, removed)]
    assert generations == list(range(generations[0], generations[0] + 4))
    templates = [d["spec"]["template"] for d in (unset, mean, last, removed)]
    assert templates[0] != templates[1] != templates[2] != templates[3]
    # Only the flag changed: removing the field brings back the first template.
    assert templates[3] == templates[0]


# --- spec.runtime.hfOverrides: an object, passed as --hf-overrides JSON -----------------------

def test_hf_overrides_is_an_optional_object() -> None:
    field = openapi_schema()["properties"]["spec"]["properties"]["runtime"]["properties"][
        "hfOverrides"]
    assert field["type"] == "object" and field["x-kubernetes-preserve-unknown-fields"] is True
    assert "--hf-overrides" in field["description"] and "default" not in field
    nested = {"is_matryoshka": True, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    defaulted, errors = validate(llmd(runtime={"hfOverrides": nested}))
    assert errors == [] and defaulted["spec"]["runtime"]["hfOverrides"] == nested
    for bad in ('{"is_matryoshka": true}', ["is_matryoshka"], 1):
        _, errors = validate(llmd(runtime={"hfOverrides": bad}))
        assert [e for e in errors if e.startswith("spec.runtime.hfOverrides:")] != [], errors


def test_hf_overrides_become_sorted_json_the_runtime_parses_back() -> None:
    model = {"name": "m", "path": "/models/m"}
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "is_matryoshka": True}
    args = serve_args_of({"model": model, "runtime": {"hfOverrides": overrides}})
    assert flag_values(args, "--hf-overrides") == [
        '{"is_matryoshka":true,"rope_scaling":{"factor":4.0,"rope_type":"yarn"}}']
    assert runtime_server_args(args).hf_overrides == overrides
    # The same overrides in another key order make the same args: no rollout on re-apply.
    reordered = dict(reversed(list(overrides.items())))
    assert serve_args_of({"model": model, "runtime": {"hfOverrides": reordered}}) == args
    for unset in ({}, {"hfOverrides": None}, {"hfOverrides": {}}):
        args = serve_args_of({"model": model, "runtime": unset})
        assert flag_values(args, "--hf-overrides") == []
        assert runtime_server_args(args).hf_overrides is None
