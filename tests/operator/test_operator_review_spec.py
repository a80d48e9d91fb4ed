"""Specs the cluster cannot run are refused twice: by the CRD at `kubectl apply` (its schema
and CEL rules, evaluated offline) and by the operator's own check (`normalize_spec`, for an
object an older CRD admitted), each naming the field. Accepted neighbours pass both."""

from __future__ import annotations

import re
from typing import Any

import pytest
from argosy_operator.builders.serve_args import serve_args
from argosy_operator.spec import InvalidSpecError, normalize_spec, tensor_parallel_size
from crd_schema import validate
from test_operator_crd_schema import _DELETE, with_spec

_ADAPTERS = [{"name": "sql", "path": "/adapters/sql"}]

# (id, spec changes, a piece of the CRD's error, the start of the operator's error)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # apps/v1: "must not be greater than 100%", on every reconcile.
    ("maxUnavailable above 100%", {"rollout__maxUnavailable": "150%"},
     "rollout.maxUnavailable must not be greater than 100%", "spec.rollout.maxUnavailable"),
    ("maxUnavailable 101%", {"rollout__maxUnavailable": "101%"},
     "rollout.maxUnavailable must not be greater than 100%", "spec.rollout.maxUnavailable"),
    # apps/v1 reads the number: "00%" is 0.
    ("both 0 with leading zeros", {"rollout": {"maxSurge": "00%", "maxUnavailable": "000"}},
     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0", "spec.rollout"),
    # The pattern checks strings only; apps/v1 refuses a negative count.
    ("negative maxSurge", {"rollout__maxSurge": -1},
     "rollout.maxSurge: -1 is less than the minimum of 0", "spec.rollout.maxSurge"),
    ("negative maxUnavailable", {"rollout__maxUnavailable": -1},
     "rollout.maxUnavailable: -1 is less than the minimum of 0",
     "spec.rollout.maxUnavailable"),
    # The runtime refuses LoRA under tensor parallelism (several GPUs: one engine over all).
    ("LoRA on two GPUs", {"resources__gpus": 2, "runtime__loraAdapters": _ADAPTERS},
     "runtime.loraAdapters cannot be served with resources.gpus > 1",
     "spec.runtime.loraAdapters"),
    # An empty list still passes --lora-modules-file, which the runtime refuses all the same.
    ("empty adapter list on four GPUs", {"resources__gpus": 4, "runtime__loraAdapters": []},
     "runtime.loraAdapters cannot be served with resources.gpus > 1",
     "spec.runtime.loraAdapters"),
    # The runtime refuses config.json overrides for a GGUF file at startup.
    ("hfOverrides on a .gguf path", {"model__path": "/models/llama.Q4_K_M.gguf",
                                     "runtime__hfOverrides": {"is_matryoshka": True}},
     "runtime.hfOverrides applies only to Hugging Face folders", "spec.runtime.hfOverrides"),
    ("hfOverrides on a gguf s3 object", {
        "model__path": _DELETE, "model__source": "s3://weights/llama/model", "model__format": "gguf",
        "runtime__hfOverrides": {"rope_scaling": {"type": "linear", "factor": 2.0}}},
     "runtime.hfOverrides applies only to Hugging Face folders", "spec.runtime.hfOverrides"),
]

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("maxUnavailable 100%", {"rollout": {"maxSurge": 0, "maxUnavailable": "100%"}}),
    ("maxUnavailable 0100%", {"rollout__maxUnavailable": "0100%"}),
    ("maxSurge above 100%", {"rollout__maxSurge": "200%"}),  # apps/v1 takes a large surge
    ("a digit-string count", {"rollout": {"maxSurge": "0", "maxUnavailable": "1"}}),
    ("a count above 100", {"rollout__maxUnavailable": 150}),
    ("LoRA on one GPU", {"resources__gpus": 1, "runtime__loraAdapters": _ADAPTERS}),
    ("LoRA on two GPUs with tensor parallelism off", {
        "resources__gpus": 2, "runtime__loraAdapters": _ADAPTERS,
        "runtime__extraArgs": ["--tensor-parallel-size", "1"]}),
    ("tensor parallelism without LoRA", {"resources__gpus": 4}),
    ("hfOverrides on a Hugging Face folder", {"model__path": "/models/qwen3-embedding",
                                              "runtime__hfOverrides": {"is_matryoshka": True}}),
]


@pytest.mark.parametrize("changes,crd_message,field", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_the_crd_and_the_operator_refuse_it(changes: dict[str, Any], crd_message: str,
                                             field: str) -> None:
    obj = with_spec(**changes)
    errors = validate(obj)[1]
    assert any(crd_message in e for e in errors), errors
    # The object as an older CRD admitted it (not defaulted by this CRD).
    with pytest.raises(InvalidSpecError, match=rf"^{re.escape(field)}: "):
        normalize_spec(obj["spec"])


@pytest.mark.parametrize("changes", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_the_crd_and_the_operator_accept_it(changes: dict[str, Any]) -> None:
    obj = with_spec(**changes)
    defaulted, errors = validate(obj)
    assert errors == []
    normalize_spec(defaulted["spec"])


@pytest.mark.parametrize("extra_args", [
    ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"], ["-tp=2"],
    ["--tensor", "2"], ["--te=2"],
    ["--tensor-parallel-size", "1", "--max-num-seqs", "8", "--tensor-parallel-size", "2"],
], ids=" ".join)
def test_lora_under_tensor_parallelism_from_extra_args_is_refused(extra_args: list[str]
                                                                  ) -> None:
    """Tensor parallelism switched on in extraArgs (on a one-GPU pod: the CRD's rule lets any
    tensor-parallel flag through, to the operator, which reads the value the runtime will)."""
    obj = with_spec(resources__gpus=1, runtime__loraAdapters=_ADAPTERS,
                    runtime__extraArgs=extra_args)
    defaulted, errors = validate(obj)
    assert errors == []
    with pytest.raises(InvalidSpecError, match=r"^spec\.runtime\.loraAdapters: .*: 2\)"):
        normalize_spec(defaulted["spec"])


@pytest.mark.parametrize("gpus,extra_args", [
    (0, []), (1, []), (4, []), (4, ["--tensor-parallel-size", "1"]), (1, ["-tp=2"]),
    (4, ["-tp", "2"]), (2, ["--te", "8"]), (1, ["--tensor-parallel=2"]),
    (4, ["--tensor-parallel-size", "2", "--max-num-seqs", "8", "--tensor-parallel-size", "1"]),
    (4, ["--max-num-seqs", "2"]),
])
def test_tensor_parallel_size_is_the_one_the_runtime_reads(gpus: int, extra_args: list[str]
                                                           ) -> None:
    """The runtime's own parser over the operator's command line."""
    from argosy_runtime.cli.main import build_parser

    spec = normalize_spec(with_spec(resources__gpus=gpus, runtime__extraArgs=extra_args)["spec"])
    expected = build_parser().parse_args(serve_args("x", spec, "/model")).tensor_parallel_size
    assert tensor_parallel_size(spec) == expected
