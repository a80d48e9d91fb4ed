"""Gateway configuration: YAML loading, flags, and errors that name the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from argosy_runtime.cli import gateway as cli
from argosy_runtime.gateway.config import (
    DEFAULT_INSTANCE_LABEL,
    ActivationConfig,
    GatewayConfig,
    KubernetesBackendConfig,
    load_config,
)

YAML = """
port: 9090
routing: {policy: least-load, prefix_chars: 128}
health: {interval_s: 0.5}
models:
  - name: tiny
    backends: [http://127.0.0.1:8001/, http://127.0.0.1:8002]
  - name: big
    policy: round-robin
    kubernetes: {llmdeployment: big, namespace: llm, source: endpointslices}
cascades:
  - {name: auto, small: tiny, large: big, keywords: [Prove], max_tokens_over: 512}
"""


def test_load_yaml(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    cfg = load_config(path)
    assert cfg.port == 9090 and cfg.health.interval_s == 0.5
    assert cfg.models[0].backends == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert cfg.models[1].kubernetes == KubernetesBackendConfig(
        llmdeployment="big", namespace="llm", source="endpointslices"
    )
    assert cfg.policy_for("tiny") == "least-load" and cfg.policy_for("big") == "round-robin"
    assert cfg.cascades[0].keywords == ("prove",)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"models": [{"name": "a", "backends": ["http://x"], "polcy": "x"}]}, r"models\[0\]\.polcy"),
        ({"models": [{"name": "a", "backends": ["http://x"], "policy": "fastest"}]}, r"models\[a\]\.policy"),
        ({"models": [{"name": "a"}]}, r"models\[a\]"),
        ({"models": [{"name": "a", "backends": ["ftp://x"]}]}, r"models\[a\]\.backends"),
        ({"routing": {"load_factor": 0.5}}, r"routing\.load_factor"),
        ({"health": {"interval_s": 0}}, r"health\.interval_s"),
        ({"port": 70000}, r"^port"),
        ({"drain_timeout_s": -1}, r"^drain_timeout_s"),
        ({"drain_timeout_s": "30s"}, r"^drain_timeout_s"),
        # NaN (YAML .nan) passed "< 0" checks: a drain of "up to nan s", a NaN health interval
        ({"drain_timeout_s": float("nan")}, r"^drain_timeout_s: must be >= 0"),
        ({"health": {"interval_s": float("nan")}}, r"health\.interval_s: must be > 0"),
        ({"routing": {"w_kv": float("nan")}}, r"routing\.w_kv: must be >= 0"),
        ({"first_byte_timeout_s": 0}, r"^first_byte_timeout_s: must be > 0"),
        ({"first_byte_timeout_s": "60s"}, r"^first_byte_timeout_s: expected a number"),
        ({"stream_idle_timeout_s": 0}, r"^stream_idle_timeout_s: must be > 0"),
        ({"stream_idle_timeout_s": float("nan")}, r"^stream_idle_timeout_s: must be > 0"),
        ({"bogus": 1}, r"config\.bogus"),
        (
            {"models": [{"name": "a", "backends": ["http://x"]}],
             "cascades": [{"name": "auto", "small": "a", "large": "zzz"}]},
            r"cascades\[auto\]\.large",
        ),
        (
            {"models": [{"name": "a", "kubernetes": {"namespace": "x"}}]},
            r"kubernetes\.llmdeployment",
        ),
        (
            {"models": [{"name": "a", "activation": {"timeout_s": 0}}]},
            r"activation\.timeout_s",
        ),
        (
            {"models": [{"name": "a", "activation": {"refresh_s": 60}}]},
            r"activation\.refresh_s: must be <= 30",
        ),
        (
            {"models": [{"name": "a", "activation": {"hold": 1}}]},
            r"models\[0\]\.activation\.hold: unknown field",
        ),
        (
            {"models": [{"name": "a", "activation": True,
                         "kubernetes": {"label_selector": "app=x"}}]},
            r"models\[a\]\.activation: needs kubernetes\.llmdeployment",
        ),
    ],
)
def test_errors_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GatewayConfig.from_dict(data)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        # Counts given as fractions used to start and then fail every request (a 500: the
        # proxy ranges over max_attempts, the ring over virtual_nodes, and slices prompts).
        ({"max_attempts": 1.5}, r"^max_attempts: expected a positive integer, got 1\.5"),
        ({"routing": {"prefix_chars": 100.5}}, r"^routing\.prefix_chars: expected a positive"),
        ({"routing": {"max_prefix_chars": 4096.0}}, r"^routing\.max_prefix_chars"),
        ({"routing": {"block_chars": 64.5}}, r"^routing\.block_chars"),
        ({"routing": {"virtual_nodes": 10.5}}, r"^routing\.virtual_nodes"),
        ({"routing": {"min_prefix_chars": 0.5}}, r"^routing\.min_prefix_chars: expected an "
                                                 r"integer >= 0"),
        ({"health": {"unhealthy_after": 1.5}}, r"^health\.unhealthy_after"),
        # Entries of the wrong type used to be an AttributeError traceback at start-up.
        ({"models": [{"name": "a", "backends": [8001]}]}, r"models\[a\]\.backends: expected a "
                                                          r"list of URLs"),
        ({"models": [{"name": "a", "backends": {"url": "http://x"}}]}, r"models\[a\]\.backends"),
        (
            {"models": [{"name": "a", "backends": ["http://x"]},
                        {"name": "b", "backends": ["http://y"]}],
             "cascades": [{"name": "auto", "small": "a", "large": "b", "keywords": [1]}]},
            r"cascades\[auto\]\.keywords: expected a list of non-empty strings",
        ),
        # `header:` left empty: a 500 for every request to the route (headers.get(None)).
        (
            {"models": [{"name": "a", "backends": ["http://x"]},
                        {"name": "b", "backends": ["http://y"]}],
             "cascades": [{"name": "auto", "small": "a", "large": "b", "header": None}]},
            r"cascades\[auto\]\.header: expected a header name, got None",
        ),
        # An empty keyword is found in every prompt: everything would go to the large model.
        (
            {"models": [{"name": "a", "backends": ["http://x"]},
                        {"name": "b", "backends": ["http://y"]}],
             "cascades": [{"name": "auto", "small": "a", "large": "b", "keywords": ["x", ""]}]},
            r"cascades\[auto\]\.keywords",
        ),
    ],
)
def test_a_mistyped_field_stops_the_start_naming_it(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GatewayConfig.from_dict(data)


def test_activation_shorthands_and_empty_static_routes() -> None:
    on = GatewayConfig.from_dict({"models": [{"name": "a", "activation": True}]})
    assert on.models[0].activation == ActivationConfig() and on.models[0].backends == ()
    off = GatewayConfig.from_dict(
        {"models": [{"name": "a", "backends": ["http://x"], "activation": False}]}
    )
    assert off.models[0].activation is None
    with pytest.raises(ValueError, match="exactly one of 'backends' or 'kubernetes'"):
        GatewayConfig.from_dict({"models": [{"name": "a", "activation": False}]})


def test_activation_refresh_fits_the_operators_freshness_window() -> None:
    from argosy_operator.autoscaling.activation import FRESH_SECONDS

    # The largest refresh_s allowed still renews a stamp twice within the operator's window.
    with pytest.raises(ValueError, match="refresh_s"):
        ActivationConfig(refresh_s=30.5)
    assert 2 * 30 <= FRESH_SECONDS


def test_default_selector_matches_the_operator_label() -> None:
    from argosy_operator.constants import LABEL_LLMD

    assert DEFAULT_INSTANCE_LABEL == LABEL_LLMD
    assert KubernetesBackendConfig(llmdeployment="m").selector == f"{LABEL_LLMD}=m"


def test_flags_override_and_add(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    args = argparse.Namespace(
        config=str(path), host="0.0.0.0", port=1234, policy="prefix-affinity",
        backend=["other=http://127.0.0.1:9001,http://127.0.0.1:9002"], drain_timeout=2.5,
    )
    cfg, _ = cli.load(args)
    assert (cfg.host, cfg.port, cfg.routing.policy) == ("0.0.0.0", 1234, "prefix-affinity")
    assert cfg.drain_timeout_s == 2.5
    assert cfg.routing.prefix_chars == 128  # untouched fields survive the override
    assert cfg.models[-1].name == "other" and len(cfg.models[-1].backends) == 2
    bad = argparse.Namespace(config=None, host=None, port=None, policy=None, backend=["nourl"],
                             drain_timeout=None)
    with pytest.raises(ValueError, match="--backend"):
        cli.build_config(bad)
