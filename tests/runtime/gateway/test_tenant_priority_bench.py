"""bench/tenant_priority.py without servers: its arguments, the gateway configs it writes (read
back by the gateway's own loader), the metrics it scrapes and the table and ratios it prints.
The run itself needs a real replica and gateway: see docs/benchmarks/tenants.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from argosy_runtime.gateway.config import load_config

# The `bench` fixture (conftest.py) imports it.
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "tenant_priority.py"


def test_arguments(bench) -> None:
    args = bench.parse_args([])
    assert args.bulk_streams >= args.max_num_seqs and args.bulk_priority > 0
    assert args.json is None and args.rounds == 1
    args = bench.parse_args(["--max-num-seqs", "2", "--bulk-streams", "2", "--rounds", "3",
                             "--json", "out.json", "--no-alone"])
    assert bench.phase_plan(args) == [("A-no-prio", 0), ("B-prio", 0), ("A-no-prio", 1),
                                      ("B-prio", 1), ("A-no-prio", 2), ("B-prio", 2)]
    assert bench.phase_plan(bench.parse_args([]))[0] == ("alone", 0)
    for bad in (["--max-num-seqs", "8", "--bulk-streams", "4"], ["--interactive", "0"],
                ["--interactive-rate", "-1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_help_runs_without_servers() -> None:
    import subprocess

    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "--bulk-priority" in proc.stdout and "--json" in proc.stdout


def test_gateway_configs_load_and_differ_only_in_the_bulk_priority(bench, tmp_path) -> None:
    args = bench.parse_args(["--gateway-port", "9321", "--bulk-priority", "7"])
    url = "http://127.0.0.1:9320"
    a = load_config(bench.write_gateway_config(tmp_path / "a.yaml", args, url, None))
    b = load_config(bench.write_gateway_config(tmp_path / "b.yaml", args, url, 7))
    assert a.port == b.port == 9321
    assert [m.backends for m in a.models] == [(url,)] and a.models[0].name == args.model
    tenants_a = {t.name: t for t in a.tenants}
    tenants_b = {t.name: t for t in b.tenants}
    assert tenants_a["interactive"].keys == (bench.INTERACTIVE_KEY,)
    assert tenants_a["bulk"].keys == (bench.BULK_KEY,)
    assert tenants_a["interactive"].priority is None and tenants_b["interactive"].priority is None
    assert tenants_a["bulk"].priority is None and tenants_b["bulk"].priority == 7


def test_metric_sum(bench) -> None:
    text = ('# HELP argosy:num_preemptions_total Requests preempted\n'
            'argosy:num_preemptions_total{model_name="m"} 3.0\n'
            'argosy:num_preemptions_created{model_name="m"} 1.7e9\n'
            'argosy:num_requests_running{model_name="m"} 4.0\n'
            'argosy:num_requests_running{model_name="n"} 1.0\n')
    assert bench.metric_sum(text, "argosy:num_preemptions_total") == 3.0
    assert bench.metric_sum(text, "argosy:num_requests_running") == 5.0
    assert bench.metric_sum(text, "argosy:num_requests_waiting") is None


def test_ratios_and_table(bench) -> None:
    def row(phase, rnd, ttft, tok_s):
        return {"phase": phase, "round": rnd, "interactive_ok": 4, "interactive_total": 4,
                "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "e2e_p50_ms": ttft + 400,
                "e2e_p90_ms": None, "bulk_tok_s": tok_s, "bulk_alone_tok_s": 150.0,
                "preemptions": 0.0, "other_cores": 0.1, "load_avg_start": 0.5}

    rows = [row("alone", 0, 100, None), row("A-no-prio", 0, 5000, 120.0),
            row("B-prio", 0, 100, 108.0), row("A-no-prio", 1, 3000, 100.0),
            row("B-prio", 1, 100, 100.0)]
    r = bench.ratios(rows)
    assert r["ttft_p50_A_over_B"] == pytest.approx(40.0)  # median of 50 and 30
    assert r["bulk_tok_s_B_over_A"] == pytest.approx(0.95)  # median of 0.9 and 1.0
    table = bench.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| alone | 0 | 4/4 | 100 |")
    assert bench.ratios(rows[:2]) == {}
