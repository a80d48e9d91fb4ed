"""The routing benchmark's bookkeeping (the run itself needs real replicas: see
docs/benchmarks/routing.md)."""

from __future__ import annotations

import pytest
from argosy_runtime.fleet.routing_bench import parse_bench_output, pick, summarize


def test_parse_bench_output_takes_the_last_json_object() -> None:
    text = 'progress 10/10\n{"ttft": {"p50_s": 0.5}}\nnoise\n{\n  "ttft_p50_s": 0.25,\n  "n": 3\n}\n'
    assert parse_bench_output(text) == {"ttft_p50_s": 0.25, "n": 3}
    with pytest.raises(ValueError):
        parse_bench_output("no json here")


def test_pick_searches_nested() -> None:
    assert pick({"a": 1, "ttft": {"median_ttft_s": 0.3}}, "p50_ttft_s", "median_ttft_s") == 0.3
    assert pick({"x": "y"}, "ttft_p50_s") is None


def test_summarize_ratios() -> None:
    runs = [
        {"policy": "round-robin", "prefix_cache_hit_rate": 0.4, "ttft_p50_s": 2.0},
        {"policy": "round-robin", "prefix_cache_hit_rate": 0.6, "ttft_p50_s": 1.0},
        {"policy": "prefix-affinity", "prefix_cache_hit_rate": 0.8, "ttft_p50_s": 0.75},
    ]
    out = summarize(runs)
    assert out["round-robin"]["prefix_cache_hit_rate_mean"] == pytest.approx(0.5)
    assert out["round-robin"]["ttft_p50_s_median"] == pytest.approx(1.5)
    assert out["ttft_p50_ratio_pa_over_rr"] == pytest.approx(0.5)
