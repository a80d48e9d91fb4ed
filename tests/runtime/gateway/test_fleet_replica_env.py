"""Fleet replicas share the machine's cores, so their OpenMP threads wait passively."""

from __future__ import annotations

import pytest
from argosy_runtime.fleet.replica_process import _replica_env


def test_replicas_wait_passively_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = _replica_env()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PYTHONUNBUFFERED"] == "1"


def test_a_users_choice_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _replica_env()["OMP_WAIT_POLICY"] == "ACTIVE"
