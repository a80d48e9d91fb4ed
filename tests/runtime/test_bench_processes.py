"""argosy_runtime.benchmarks.processes and .results: how the bench/ scripts start their servers
and record what they measured."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
from argosy_runtime.benchmarks.processes import start_process, stop_process
from argosy_runtime.benchmarks.results import utc_now, write_results
from argosy_runtime.fleet.replica_process import free_port


def test_a_server_is_returned_once_it_answers_and_stopped_with_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process([sys.executable, "-m", "http.server", str(port), "--bind",
                          "127.0.0.1"], tmp_path / "server.log", f"http://127.0.0.1:{port}/")
    assert proc.poll() is None
    stop_process(proc)
    assert proc.returncode is not None
    stop_process(proc)  # already gone: nothing to do


def test_a_process_that_exits_first_is_an_error_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        start_process([sys.executable, "-c", "print('boom')"], tmp_path / "x.log",
                      f"http://127.0.0.1:{free_port()}/")


def test_a_results_record_names_the_command_that_reproduces_it(tmp_path: Path) -> None:
    args = argparse.Namespace(rate=2.0, json=str(tmp_path / "out" / "r.json"))
    write_results(args.json, "bench/x.py", ["--rate", "2", "--label", "a b"], utc_now(), args,
                  rows=[{"ttft": 0.1}])
    record = json.loads(Path(args.json).read_text())
    assert record["command"] == "python bench/x.py --rate 2 --label 'a b'"
    assert record["args"] == {"rate": 2.0, "json": args.json} and record["rows"] == [{"ttft": 0.1}]
    assert record["cpus"] == os.cpu_count() and record["started_utc"].endswith("+00:00")
