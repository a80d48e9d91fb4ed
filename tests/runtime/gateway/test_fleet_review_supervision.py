"""`argosy fleet` as a process supervisor: what it must do for replicas it drains, restarts and
places on ports. The replicas are light stand-ins (fake_replica.py, or small scripts built on
it) since the model is not the point here."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from argosy_runtime.fleet import supervisor
from argosy_runtime.fleet.replica_process import ReplicaProcess
from argosy_runtime.fleet.supervisor import Fleet, FleetConfig
from gateway_helpers import FAKE_REPLICA, FLAKY

HERE = Path(__file__).parent

# fake_replica.py with `argosy serve`'s drain: the first SIGTERM drains (here: 1.5 s, then exit
# 0) and writes $DRAIN_MARK; a second SIGTERM during the drain exits at once (code 3), cutting
# what was still running (server/lifecycle.py).
DRAINING_REPLICA = f"""
import argparse, asyncio, os, signal, sys
sys.path.insert(0, {str(HERE)!r})
from fake_replica import FakeReplica

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
args, _ = parser.parse_known_args()

async def serve():
    replica = FakeReplica(model="tiny")
    await replica.start(port=args.port)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    state = {{"draining": False}}

    def on_sigterm():
        if state["draining"]:
            os._exit(3)
        state["draining"] = True
        open(os.environ["DRAIN_MARK"], "w").close()
        loop.call_later(1.5, done.set)

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    await done.wait()
    await replica.stop()

asyncio.run(serve())
"""


async def _wait_for(check, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_fleet_stopped_while_a_replica_drains_lets_the_drain_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The autoscaler drains a replica (SIGTERM: its requests finish); the fleet is stopped
    meanwhile. stop() must not send that replica a second SIGTERM, which `argosy serve` takes
    as "exit at once", cutting the requests the drain was letting finish."""
    script = tmp_path / "draining_replica.py"
    script.write_text(DRAINING_REPLICA)
    mark = tmp_path / "drain-started"
    monkeypatch.setenv("DRAIN_MARK", str(mark))
    fleet = Fleet(FleetConfig(
        model="tiny", replicas=1, port=0, serve_command=(sys.executable, str(script)),
        health_interval_s=0.2, log_dir=str(tmp_path), ready_timeout_s=30, drain_timeout_s=10,
        liveness_timeout_s=0))  # fmt: skip
    await fleet.start()
    proc = fleet.processes[0]
    try:
        fleet._spawn(fleet.drain_replica(proc))  # as a scale-down does
        await _wait_for(mark.exists, 10, "the replica to begin its drain")
    finally:
        await fleet.stop()
    assert proc.process is not None
    assert proc.process.returncode == 0, "a second SIGTERM cut the replica's drain short"


def test_replicas_starting_together_get_different_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """free_port() releases the port it found, so two calls may return the same one; a port
    given to a replica that has not bound it yet must not be given to a second one (the second
    would poll the first's /ready, be taken as ready, then exit on "address in use", and the
    fleet would take the healthy first one out of rotation with it)."""
    ports = iter([41001, 41001, 41002])
    monkeypatch.setattr(supervisor, "free_port", lambda *a, **k: next(ports))
    fleet = Fleet(FleetConfig(model="tiny", replicas=2, port=0, log_dir=str(tmp_path)))
    first = fleet._new_process()
    fleet.processes.append(first)
    second = fleet._new_process()
    assert first.port == 41001
    assert second.port == 41002


async def test_a_replica_that_exited_is_counted_as_starting_until_its_replacement_runs(
    tmp_path: Path,
) -> None:
    """_watch_processes takes an exited replica out and spawns its replacement; until the
    replacement task runs, the autoscaler (another task, possibly next in the loop's queue)
    must still count it, or it starts a replica of its own for the same gap (one too many)."""
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, log_dir=str(tmp_path)))
    proc = ReplicaProcess("tiny", "tiny", 41003, log_dir=tmp_path,
                          serve_command=(sys.executable, "-c", "pass"))
    await proc.start()
    await proc.process.wait()
    proc.ready, proc.ready_at = True, time.monotonic() - 600
    fleet.processes.append(proc)
    counted: list[int] = []
    spawned = asyncio.Event()

    def spawn(coro) -> None:  # noqa: ANN001
        # What the autoscaler would count if it ran now, before the replacement task does.
        counted.append(len(fleet.live) + fleet._replacing)
        coro.close()
        spawned.set()

    fleet._spawn = spawn  # type: ignore[method-assign]
    watch = asyncio.get_running_loop().create_task(fleet._watch_processes())
    try:
        await asyncio.wait_for(spawned.wait(), 5)
    finally:
        watch.cancel()
    assert counted == [1]


def test_a_replicas_log_tail_reads_only_the_end_of_a_large_log(tmp_path: Path) -> None:
    """log_tail runs on the event loop the gateway serves from (a replica exited, or did not
    start): reading a replica's whole log (gigabytes after days at debug level, appended
    across restarts on one port) would stall every request and hold it all in memory."""
    import tracemalloc

    proc = ReplicaProcess("tiny", "tiny", 41004, log_dir=tmp_path)
    line = b"x" * 99 + b"\n"
    with open(proc.log_path, "wb") as f:
        f.write(line * 300_000)  # 30 MB
        f.write(b"error: the last words\n")
    tracemalloc.start()
    try:
        tail = proc.log_tail(3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tail.splitlines() == ["x" * 99, "x" * 99, "error: the last words"]
    assert peak < 4_000_000, f"log_tail held {peak / 1e6:.0f} MB to return 3 lines"



# Each process appends its pid to $STARTS. The first one started exits 1 at once (a model that
# does not load); the others are slow to load and, when SIGTERM stops them, end their log as a
# replica that lost its port does (as a log appended to across restarts on one port may).
ONE_FAILS_AT_ONCE = f"""
import os, signal, sys, time
with open(os.environ["STARTS"], "a") as f:
    f.write(f"{{os.getpid()}}\\n")
try:
    os.close(os.open(os.environ["STARTS"] + ".first", os.O_CREAT | os.O_EXCL))
    print("error: cannot load the model", flush=True)
    sys.exit(1)
except FileExistsError:
    pass
def on_sigterm(*_):
    print("OSError: [Errno 98] address already in use", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, on_sigterm)
time.sleep(3)
sys.argv[0] = {FAKE_REPLICA!r}
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


async def test_a_replica_failing_at_start_ends_the_others_start_ups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the replicas fails to start, so start() fails and stops the fleet: the other
    replicas' start-ups must end with it, not run on behind stop() (here: one taken for a
    lost port is started again on another, after the fleet stopped, and left running)."""
    import psutil

    script = tmp_path / "one_fails.py"
    script.write_text(ONE_FAILS_AT_ONCE)
    starts = tmp_path / "starts"
    monkeypatch.setenv("STARTS", str(starts))
    fleet = Fleet(FleetConfig(
        model="tiny", replicas=2, port=0, serve_command=(sys.executable, str(script)),
        log_dir=str(tmp_path), ready_timeout_s=30, drain_timeout_s=5))  # fmt: skip
    with pytest.raises(RuntimeError, match="before it was ready"):
        await fleet.start()
    await asyncio.sleep(1.5)  # a start-up left running would have started its next try
    pids = [int(p) for p in starts.read_text().split()]
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for pid in alive:
        psutil.Process(pid).kill()
    assert len(pids) == 2 and alive == [], f"started {len(pids)}, {len(alive)} left running"


async def test_scale_down_keeps_the_ready_replica_while_a_replacement_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas, one dies and its replacement keeps failing (retried with backoff), the
    fleet goes idle: the autoscaler counts the pending replacement as a replica and wants one
    fewer. It must not drain the one replica that serves, leaving none."""
    fail = tmp_path / "FAIL"
    monkeypatch.setenv("FAIL_IF_EXISTS", str(fail))
    flaky = tmp_path / "flaky.py"
    flaky.write_text(FLAKY)
    fleet = Fleet(FleetConfig(
        model="tiny", replicas=2, min_replicas=1, max_replicas=2, port=0,
        autoscaling={"scrapeIntervalSeconds": 0.3, "stableWindowSeconds": 1.5,
                     "panicWindowSeconds": 0.6, "scaleDownStabilizationSeconds": 2.5},
        serve_command=(sys.executable, str(flaky)), health_interval_s=0.15,
        log_dir=str(tmp_path / "logs"), ready_timeout_s=30, drain_timeout_s=5,
        liveness_timeout_s=0))  # fmt: skip
    await fleet.start()
    survivor, dying = fleet.processes
    try:
        fail.touch()  # from now on the model "does not load"
        await dying.kill()
        await _wait_for(lambda: dying not in fleet.processes, 5, "the dead replica's removal")
        # Long enough for the autoscaler to decide 2 -> 1 (idle, stabilization 2.5 s).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert survivor.alive and not survivor.draining, "the only serving replica drained"
            await asyncio.sleep(0.1)
        assert fleet.gateway.pools["tiny"].get(survivor.url) is not None
        assert any(d.desired_replicas == 1 for d in fleet.decisions), "no scale-down decided"
    finally:
        await fleet.stop()


async def test_scale_down_drains_a_failing_replica_before_a_healthy_one(tmp_path: Path) -> None:
    """Idle, the fleet scales 2 -> 1 while one replica fails its health checks (out of
    rotation: /ready and /health fail, not yet for its liveness timeout): the failing one goes,
    not the one serving."""
    import aiohttp

    fleet = Fleet(FleetConfig(
        model="tiny", replicas=2, min_replicas=1, max_replicas=2, port=0,
        autoscaling={"scrapeIntervalSeconds": 0.3, "stableWindowSeconds": 1.5,
                     "panicWindowSeconds": 0.6, "scaleDownStabilizationSeconds": 1.5},
        serve_command=(sys.executable, FAKE_REPLICA), health_interval_s=0.15,
        log_dir=str(tmp_path), ready_timeout_s=30, drain_timeout_s=5,
        liveness_timeout_s=60))  # fmt: skip
    await fleet.start()
    # The first in the fleet's list (both idle) is the one an order ignoring health drains.
    serving, failing = fleet.processes
    try:
        async with aiohttp.ClientSession() as s:
            await s.post(f"{failing.url}/control", json={"healthy": False, "ready": False})
        pool = fleet.gateway.pools["tiny"]
        await _wait_for(lambda: (r := pool.get(failing.url)) is None or not r.healthy, 10,
                        "the gateway to notice")
        await _wait_for(lambda: len(fleet.live) == 1, 15, "the scale-down")
        assert fleet.live == [serving]
    finally:
        await fleet.stop()


async def test_a_replica_drain_timeout_longer_than_the_fleets_is_not_cut_by_sigkill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-- --drain-timeout N` lets each replica's requests finish for N s on SIGTERM; the
    fleet SIGKILLed a draining replica after its own drain timeout (60 s) whatever N was,
    cutting them, and its gateway cut the answers in flight on stop after 30 s. Here the
    replica drains for 1.5 s, the fleet's own timeout is 0.5 s and --drain-timeout 5."""
    script = tmp_path / "draining_replica.py"
    script.write_text(DRAINING_REPLICA)
    monkeypatch.setenv("DRAIN_MARK", str(tmp_path / "drain-started"))
    fleet = Fleet(FleetConfig(
        model="tiny", replicas=1, port=0, serve_command=(sys.executable, str(script)),
        serve_args=("--drain-timeout", "5"), health_interval_s=0.2, log_dir=str(tmp_path),
        ready_timeout_s=30, drain_timeout_s=0.5, liveness_timeout_s=0))  # fmt: skip
    await fleet.start()
    try:
        assert fleet.gateway.config.drain_timeout_s == 5
        code = await fleet.drain_replica(fleet.processes[0])  # as a scale-down does
    finally:
        await fleet.stop()
    assert code == 0, "the replica was killed mid-drain"


async def test_a_replicas_log_tail_is_its_own_not_an_earlier_one_on_its_port(
    tmp_path: Path,
) -> None:
    """Replica logs are named by port and appended to: a replica failing at start on a port
    an earlier one had used showed that one's last words as its own, and an earlier "address
    already in use" there had it taken for a lost port and started again elsewhere."""
    earlier = "OSError: [Errno 98] address already in use"
    (tmp_path / "replica-41005.log").write_text(f"{earlier}\n")
    proc = ReplicaProcess("tiny", "tiny", 41005, log_dir=tmp_path, serve_command=(
        sys.executable, "-c", "print('error: cannot load the model')"))
    await proc.start()
    await proc.process.wait()
    assert proc.log_tail() == "error: cannot load the model"
    assert not supervisor._port_taken(proc.log_tail())
    assert earlier in proc.log_path.read_text(), "the earlier replica's log was overwritten"


def test_quick_exits_long_apart_are_not_a_crash_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas exiting soon after becoming ready, in a row, are a crash loop whose restarts
    back off. The count was never reset by time: a loop that ended (its replica serving for
    hours since) made the next replica exiting soon after its start wait 60 s to be replaced,
    logged as "8 in a row"."""
    now = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, log_dir=str(tmp_path)))

    def quick_exit() -> float:
        proc = ReplicaProcess("tiny", "tiny", 41006, log_dir=tmp_path)
        proc.ready_at = now[0] - 5  # ready 5 s before it exited
        return fleet._restart_wait(proc)

    waits = []
    for _ in range(8):  # the crash loop
        waits.append(quick_exit())
        now[0] += waits[-1] + 10  # the replacement starts, is ready, exits
    assert waits[0] == 0 and waits[1:] == sorted(waits[1:]) and waits[-1] == 60
    now[0] += 6 * 3600  # the last replacement has served for hours
    assert quick_exit() == 0
