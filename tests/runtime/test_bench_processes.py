"""argosy_runtime.benchmarks.processes, which the bench/ scripts start their servers with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from argosy_runtime.benchmarks.processes import start_process, stop_process
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
