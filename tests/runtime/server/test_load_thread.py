"""`argosy serve` loads the model off the main thread (one OpenMP pool in the process)."""

from __future__ import annotations

import threading

import pytest
from argosy_runtime.cli.serve import _off_main_thread


def test_runs_on_another_thread_and_returns_the_result() -> None:
    assert _off_main_thread(lambda x: (x, threading.current_thread().name), 7) == (7, "argosy-load")


def test_reraises_the_error_on_the_caller() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        _off_main_thread(fail)
