"""Follow-ups to the operator's robustness pass: bounds the CRD and the operator's own checks
must agree on, validation regexes that must not accept a trailing newline, and abbreviated
`argosy serve` flags in spec.runtime.extraArgs."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest
from argosy_operator.autoscaling.policy import AutoscalingPolicy
from argosy_operator.builders.common import check_name
from argosy_operator.model_source import parse_model_source
from argosy_operator.spec import RESERVED_SERVE_FLAGS, normalize_spec

BASE: dict[str, Any] = {"apiVersion": "argosy.dev/v1alpha1", "kind": "LLMDeployment",
                        "metadata": {"name": "x", "namespace": "ml"},
                        "spec": {"model": {"name": "m", "path": "smollm2-135m"}}}


def _spec(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE["spec"]), **fields}


# --- autoscaling.maxReplicas is bounded like spec.replicas (the CRD: test_operator_crd_schema) -

def test_max_replicas_is_capped_by_the_operators_policy_check() -> None:
    assert AutoscalingPolicy.from_spec({"maxReplicas": 1000}).max_replicas == 1000
    with pytest.raises(ValueError, match="maxReplicas: must be <= 1000"):
        AutoscalingPolicy.from_spec({"maxReplicas": 1001})


# --- validation regexes take no trailing newline (Python's `$` matches before one) ---------

@pytest.mark.parametrize("interval", ["15s\n", "1m30s\n"])
def test_monitoring_interval_with_a_trailing_newline_is_refused(interval: str) -> None:
    normalize_spec(_spec(monitoring={"interval": interval.strip()}))
    with pytest.raises(ValueError, match="spec.monitoring.interval"):
        normalize_spec(_spec(monitoring={"interval": interval}))


def test_a_name_with_a_trailing_newline_cannot_name_the_children() -> None:
    check_name("chat")
    with pytest.raises(ValueError, match="metadata.name"):
        check_name("chat\n")


@pytest.mark.parametrize("source", ["hf://org/name", "hf://org/name/m.gguf",
                                    "s3://bucket/key", "pvc://claim", "pvc://claim/sub"])
def test_a_model_source_with_a_trailing_newline_is_refused(source: str) -> None:
    parse_model_source(source, None)
    with pytest.raises(ValueError, match="spec.model.source"):
        parse_model_source(source + "\n", None)


# --- abbreviated reserved flags in extraArgs ------------------------------------------------

def _serve_parser() -> argparse.ArgumentParser:
    # Tests may import the runtime (the operator image may not: it has no torch).
    from argosy_runtime.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _resolves_to(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The option `argosy serve`'s parser takes `flag` for (None: unknown or ambiguous)."""
    matches = [o for a in parser._actions for o in a.option_strings if o == flag]
    if matches:
        return flag
    if not parser.allow_abbrev:
        return None
    prefixed = {o for a in parser._actions for o in a.option_strings if o.startswith(flag)}
    return prefixed.pop() if len(prefixed) == 1 else None


def test_every_abbreviation_argparse_expands_to_a_reserved_flag_is_refused() -> None:
    parser = _serve_parser()
    assert parser.allow_abbrev  # else there is nothing to catch
    abbreviations = [(flag[:n], flag) for flag in RESERVED_SERVE_FLAGS
                     for n in range(3, len(flag))
                     if _resolves_to(parser, flag[:n]) == flag]
    assert ("--por", "--port") in abbreviations and ("--p", "--port") in abbreviations
    for abbrev, flag in abbreviations:
        for args in ([abbrev, "9000"], [f"{abbrev}=9000"]):
            with pytest.raises(ValueError, match=f"{abbrev} .*{flag}"):
                normalize_spec(_spec(runtime={"extraArgs": args}))


def test_every_other_serve_flag_is_still_accepted() -> None:
    """Flags that are themselves a prefix of a reserved one (`--lora-modules`) are exact
    matches for argparse, not abbreviations."""
    parser = _serve_parser()
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    others = sorted(flags - set(RESERVED_SERVE_FLAGS) - {"--help"})
    assert "--lora-modules" in others
    for flag in others:
        normalize_spec(_spec(runtime={"extraArgs": [flag]}))
