"""spec.runtime.embeddingPooling: how /v1/embeddings pools a prompt's hidden states
(`--embedding-pooling last|mean`), left to the runtime's default when unset."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from argosy_operator.builders import build_deployment
from argosy_operator.spec import DEFAULTS, normalize_spec
from conftest import NS, Api, eventually, settle
from crd_schema import openapi_schema, validate

BASE: dict[str, Any] = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                        "metadata": {"name": "x", "namespace": "ml"},
                        "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}

LLMD_PATH = f"/apis/argosy.dev/v1alpha1/namespaces/{NS}/llmdeployments"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"


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


def test_the_crd_field_is_an_optional_last_or_mean_enum() -> None:
    field = openapi_schema()["properties"]["spec"]["properties"]["runtime"]["properties"][
        "embeddingPooling"]
    assert field["type"] == "string" and field["enum"] == ["last", "mean"]
    assert "default" not in field  # unset: the runtime's own default applies
    assert "--embedding-pooling" in field["description"]  # what kubectl explain shows
    assert "embeddingPooling" not in DEFAULTS["runtime"]
    defaulted, errors = validate(llmd())
    assert errors == []
    assert "embeddingPooling" not in defaulted["spec"]["runtime"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_crd_accepts_last_and_mean(pooling: str) -> None:
    defaulted, errors = validate(llmd(runtime={"embeddingPooling": pooling}))
    assert errors == []
    assert defaulted["spec"]["runtime"]["embeddingPooling"] == pooling


@pytest.mark.parametrize("pooling", ["cls", "Mean", "", "max", 1, True])
def test_the_crd_rejects_other_values(pooling: Any) -> None:
    _, errors = validate(llmd(runtime={"embeddingPooling": pooling}))
    assert [e for e in errors if e.startswith("spec.runtime.embeddingPooling:")] != [], errors


@pytest.mark.parametrize("runtime,pooling", [
    ({}, None),
    ({"embeddingPooling": None}, None),
    ({"embeddingPooling": "last"}, "last"),
    ({"embeddingPooling": "mean"}, "mean"),
], ids=["absent", "null", "last", "mean"])
def test_the_flag_is_passed_only_when_set(runtime: dict[str, Any], pooling: str | None
                                          ) -> None:
    args = serve_args_of({"model": {"name": "m", "path": "/models/m"}, "runtime": runtime})
    flags = [a for a in args if "embedding-pooling" in a]
    if pooling is None:
        assert flags == []
        # Left out, the runtime's default applies.
        assert runtime_server_args(args).embedding_pooling == "last"
    else:
        assert flags == ["--embedding-pooling"]
        assert args[args.index("--embedding-pooling") + 1] == pooling
        assert runtime_server_args(args).embedding_pooling == pooling
    # Each case against the others: only a set field changes the args.
    without = serve_args_of({"model": {"name": "m", "path": "/models/m"}})
    assert (args != without) == (pooling is not None)
    assert serve_args_of({"model": {"name": "m", "path": "/models/m"},
                          "runtime": {"embeddingPooling": "mean"}}) != without


def test_extra_args_come_after_the_field_and_win() -> None:
    """No deduplication: the field's flag first, extraArgs after, and argparse keeps the
    last, so a `--embedding-pooling` in extraArgs overrides the field (docs/operator.md)."""
    args = serve_args_of({"model": {"name": "m", "path": "/models/m"},
                          "runtime": {"embeddingPooling": "last",
                                      "extraArgs": ["--embedding-pooling", "mean"]}})
    assert args[-2:] == ["--embedding-pooling", "mean"]
    assert [i for i, a in enumerate(args) if a == "--embedding-pooling"][0] < len(args) - 2
    assert runtime_server_args(args).embedding_pooling == "mean"


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
    patches the Deployment's template (a new ReplicaSet: the pods roll)."""
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
