"""bench/cascade.py without servers: its arguments, the gateway configs it writes (read back by
the gateway's loader), the request mix, and the helpers that turn answers into the table
(tokens and mean logprob, prefix agreement, the decision counter, per-arm summary). The run
itself needs two real replicas and a gateway: see docs/benchmarks/cascade.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from argosy_runtime.gateway.config import load_config

# The `bench` fixture (conftest.py) imports it.
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "cascade.py"


def test_arguments(bench) -> None:
    args = bench.parse_args([])
    assert args.small_quantization == "int4" and args.large_dtype == "float32"
    assert args.thresholds == [-0.6, -0.7, -0.9] and args.concurrency == 2
    assert bench.parse_args(["--thresholds=-0.3,-1"]).thresholds == [-0.3, -1.0]
    for bad in (["--thresholds", "0.5"], ["--thresholds", ""], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_gateway_configs_load(bench, tmp_path: Path) -> None:
    args = bench.parse_args(["--port", "9340"])
    small, large = "http://127.0.0.1:9341", "http://127.0.0.1:9342"
    loaded = {}
    for threshold in (None, -0.7):
        path = tmp_path / f"{threshold}.yaml"
        path.write_text(bench.yaml.safe_dump(bench.gateway_config(args, small, large, threshold)))
        loaded[threshold] = load_config(path)
    config = loaded[-0.7]
    assert config.port == 9340
    assert {m.name: m.backends for m in config.models} == {"small": (small,), "large": (large,)}
    (cascade,) = config.cascades
    assert (cascade.name, cascade.small, cascade.large) == ("auto", "small", "large")
    assert cascade.min_mean_logprob == -0.7
    # No up-front rule: only the confidence check can pick the large model.
    assert cascade.prompt_chars_over is None and cascade.max_tokens_over is None
    assert cascade.keywords == ()
    assert loaded[None].cascades[0].min_mean_logprob is None


def test_request_mix_is_seeded_half_easy_greedy_non_streamed(bench) -> None:
    args = bench.parse_args(["--requests", "10", "--max-tokens", "16"])
    mix = bench.request_mix(args)
    assert mix == bench.request_mix(args) != bench.request_mix(bench.parse_args(
        ["--requests", "10", "--max-tokens", "16", "--seed", "1"]))
    prompts = [b["messages"][0]["content"] for b in mix]
    assert sum(p in bench.EASY for p in prompts) == sum(p in bench.HARD for p in prompts) == 5
    assert all(b["temperature"] == 0 and b["max_tokens"] == 16 and b["logprobs"]
               and not b["stream"] and "model" not in b for b in mix)


def test_answer_tokens_and_prefix_agreement(bench) -> None:
    answer = {"choices": [{"message": {"content": "Hola."}, "logprobs": {"content": [
        {"token": "Hola", "logprob": -0.5}, {"token": ".", "logprob": -1.5}]}}]}
    assert bench.answer_tokens(answer) == ("Hola.", ["Hola", "."], -1.0)
    bare = {"choices": [{"message": {"content": None}, "logprobs": None}]}
    assert bench.answer_tokens(bare) == ("", [], None)
    assert bench.prefix_agreement(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert bench.prefix_agreement(["a", "x", "c"], ["a", "b", "c"]) == pytest.approx(1 / 3)
    assert bench.prefix_agreement(["a", "b"], ["a", "b", "c", "d"]) == 0.5  # over the longer
    assert bench.prefix_agreement([], []) == 1.0


def test_metric_counts(bench) -> None:
    text = ('# TYPE argosy:gateway_cascade_decisions_total counter\n'
            'argosy:gateway_cascade_decisions_total{reason="confident",route="auto",'
            'tier="small"} 5.0\n'
            'argosy:gateway_cascade_decisions_total{reason="low_confidence",route="auto",'
            'tier="large"} 19.0\n'
            'argosy:gateway_cascade_decisions_created{reason="confident",route="auto",'
            'tier="small"} 1.7e9\n')
    assert bench.metric_counts(text, bench.DECISIONS) == {
        "small/confident": 5.0, "large/low_confidence": 19.0}


def test_summarize_predict_and_table(bench) -> None:
    def rec(text, tier, latency, mean=None, reason=None):
        return {"ok": True, "text": text, "tokens": text.split(), "tier": tier,
                "latency_s": latency, "mean_logprob": mean, "reason": reason,
                "confidence": mean}

    reference = [rec("a b", "large", 2.0), rec("c d", "large", 2.0),
                 rec("e f", "large", 2.0), {"ok": False, "error": "HTTP 500: x"}]
    cascade = [rec("a b", "small", 0.5, -0.3, "confident"),
               rec("c x", "small", 0.5, -0.4, "confident"),
               rec("e f", "large", 3.0, -1.2, "low_confidence"),
               rec("g h", "small", 0.5, -0.2, "confident")]
    row = bench.summarize("auto -0.5", cascade, 2.0, reference)
    assert row["ok"] == 4 and row["requests_per_s"] == 2.0
    assert row["small_fraction"] == 0.75 and row["large_fraction"] == 0.25
    assert row["reasons"] == {"small/confident": 3, "large/low_confidence": 1}
    # Only requests the reference answered are compared: 2 of 3 exact, prefixes 1, 0.5, 1.
    assert row["exact_match"] == pytest.approx(2 / 3)
    assert row["prefix_agreement"] == pytest.approx(2.5 / 3)
    assert row["latency_mean_ms"] == pytest.approx(1125)
    assert bench.predicted_small_fraction(cascade, -0.5) == 0.75
    assert bench.predicted_small_fraction(cascade, -0.25) == 0.25
    table = bench.format_table([row])
    assert "| auto -0.5 | 4/4 | 1125 /" in table and "| 75 % / 25 % | 67 % | 0.83 |" in table
