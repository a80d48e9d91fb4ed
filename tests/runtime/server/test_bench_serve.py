"""`argosy bench serve`: workload generation, and a short real run against the shared server."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from argosy_runtime.benchmarks.serve import (
    RequestResult,
    arrival_times,
    make_requests,
    percentile,
    rate_seed,
    summarize,
)
from serve_harness import ServerProcess, free_port


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = arrival_times(4000, rate=5.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.08)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.12)
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 2.0, 7) == arrival_times(50, 2.0, 7)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0, 0)


def test_datasets() -> None:
    fixed = make_requests("synthetic", 5, 20, 7, seed=1)
    assert all(len(r.prompt.split()) == 20 and r.output_len == 7 for r in fixed)
    assert make_requests("synthetic", 5, 20, 7, seed=1) == fixed
    assert rate_seed(1, 0) == 1  # the first rate keeps the seed, later ones get new prompts
    assert make_requests("synthetic", 5, 20, 7, seed=rate_seed(1, 1)) != fixed
    mixed = make_requests("synthetic-mixed", 200, 40, 40, seed=1)
    lens = [len(r.prompt.split()) for r in mixed]
    assert min(lens) >= 10 and max(lens) <= 70 and len(set(lens)) > 20
    assert statistics.mean(r.output_len for r in mixed) == pytest.approx(40, rel=0.15)
    shared = make_requests("shared-prefix", 4, 40, 8, seed=1, prefix_len=30)
    prefixes = {" ".join(r.prompt.split()[:30]) for r in shared}
    assert len(prefixes) == 1 and len({r.prompt for r in shared}) == 4
    with pytest.raises(ValueError, match="dataset"):
        make_requests("nope", 1, 1, 1, 0)


def test_summary_percentiles() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    results = [RequestResult(ok=True, start=0, ttft=0.1 * i, e2e=1.0 + 0.1 * i,
                             itls=[0.05] * 9, output_tokens=10, prompt_tokens=5)
               for i in range(1, 5)] + [RequestResult(ok=False, start=0, error="HTTP 429")]
    s = summarize(results, duration=2.0, rate=4.0)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["output_tokens_per_s"] == pytest.approx(20.0)
    assert s["p50_ttft_s"] == pytest.approx(0.25)
    assert s["p99_itl_s"] == pytest.approx(0.05)
    assert s["errors"] == ["HTTP 429"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", "bench", "serve",
                           *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_serve_against_the_server(server: ServerProcess, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = _bench("--base-url", server.url, "--rate", "20,inf", "--num-prompts", "6",
               "--input-len", "12", "--output-len", "4", "--dataset", "synthetic-mixed",
               "--json", str(out), "--plot", str(png), "--label", "argosy")
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    rows = data["runs"]["argosy"]
    assert [r["rate"] for r in rows] == [20.0, "inf"]
    for i, r in enumerate(rows):  # each rate its own prompts (no prefix-cache hits across rates)
        expected_tokens = sum(s.output_len for s in make_requests("synthetic-mixed", 6, 12, 4,
                                                                  rate_seed(0, i)))
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["output_tokens"] == expected_tokens  # ignore_eos: exact lengths
        assert 0 < r["p50_ttft_s"] <= r["p99_ttft_s"] < r["p50_e2e_s"] * 2
        assert r["p50_itl_s"] > 0 and r["output_tokens_per_s"] > 0
    assert "| rate/s |" in p.stdout and png.stat().st_size > 10_000
    merged = tmp_path / "m.json"
    p = _bench("--compare", str(out), str(out), "--json", str(merged), "--plot",
               str(tmp_path / "m.png"))
    assert p.returncode == 0 and "argosy" in json.loads(merged.read_text())["runs"]


def test_bench_serve_counts_failures(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    p = _bench("--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--rate", "inf",
               "--num-prompts", "3", "--json", str(tmp_path / "f.json"), "--warmup", "0")
    assert p.returncode == 1
    row = json.loads((tmp_path / "f.json").read_text())["runs"]["m"][0]
    assert (row["completed"], row["failed"]) == (0, 3) and row["errors"]


@pytest.mark.slow
def test_a_failing_warm_up_stops_the_run_before_it_starts(server: ServerProcess,
                                                          tmp_path: Path) -> None:
    # A mistyped --model: one line naming the server's answer, not a run of 100 failures.
    p = _bench("--base-url", server.url, "--model", "no-such-model", "--num-prompts", "100",
               "--json", str(tmp_path / "f.json"))
    assert p.returncode == 1
    assert p.stderr.startswith("argosy bench serve: the warm-up request failed: HTTP 404"), \
        p.stderr
    assert not (tmp_path / "f.json").exists()
    assert _bench("--warmup", "-1").returncode == 2
