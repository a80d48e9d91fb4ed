"""Fleet replicas share the machine's cores, so their OpenMP threads wait passively; and they
exit with the fleet, even a fleet killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from argosy_runtime.fleet.replica_process import _replica_env
from test_fleet_robustness import STUBBORN


def test_replicas_wait_passively_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = _replica_env()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PYTHONUNBUFFERED"] == "1"


def test_a_users_choice_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _replica_env()["OMP_WAIT_POLICY"] == "ACTIVE"


PARENT = """
import asyncio, sys
from argosy_runtime.fleet.replica_process import ReplicaProcess, free_port

async def main():
    replica = ReplicaProcess("smollm2-135m", "m", free_port(), log_dir=sys.argv[1],
                             extra_args=["--kv-cache-memory", "64MiB"])
    await replica.start()
    print(replica.process.pid, flush=True)
    print("ready" if await replica.wait_ready(180) else "not ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_replica_exits_when_its_fleet_is_killed(tmp_path) -> None:
    """SIGKILL runs none of the fleet's clean-up; its replica must not live on as an orphan
    holding its port and a copy of the model."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        replica_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready", (tmp_path / "logs").glob("*")
        assert _running(replica_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while _running(replica_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(replica_pid):
        os.kill(replica_pid, signal.SIGKILL)
        pytest.fail("the replica outlived its killed fleet")


# A replica that SIGTERM does not stop (a hung event loop; here SIGTERM is ignored), ready at
# once; it asks to exit with its fleet as `argosy serve` does.
STUBBORN_REPLICA = ("from argosy_runtime.fleet.exit_with_parent import exit_with_parent_if_asked\n"
                    "exit_with_parent_if_asked()\n" + STUBBORN)

FLEET = """
import asyncio, sys
from argosy_runtime.fleet.supervisor import Fleet, FleetConfig

async def main():
    fleet = Fleet(FleetConfig(model="m", replicas=1, port=0, log_dir=sys.argv[2],
                              serve_command=(sys.executable, sys.argv[1]),
                              drain_timeout_s=3, ready_timeout_s=60))
    await fleet.start()
    print(fleet.processes[0].process.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_replica_that_ignores_sigterm_exits_when_its_fleet_is_killed(tmp_path) -> None:
    """A live fleet SIGKILLs a replica that has not drained within its drain timeout; a
    killed fleet's replica got only PR_SET_PDEATHSIG's SIGTERM, and one that could not act
    on it lived on for good, holding its port and its model."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_REPLICA)
    fleet = subprocess.Popen([sys.executable, "-c", FLEET, str(script), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        replica_pid = int(fleet.stdout.readline())
        assert _running(replica_pid)
    finally:
        fleet.kill()
        fleet.wait()
        fleet.stdout.close()
    deadline = time.monotonic() + 60  # 3 s of grace, on a loaded machine
    while _running(replica_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(replica_pid):
        os.kill(replica_pid, signal.SIGKILL)
        pytest.fail("the replica outlived its killed fleet")
    log = next(tmp_path.glob("replica-*.log")).read_text()
    assert "SIGTERM did not stop it within 3 s" in log, log
