"""`argosy fleet` under misuse and failure: bad flags, a busy gateway port, signals while the
replicas load, replicas that die and whose replacements fail. Real processes and signals; the
replicas are light stand-ins (fake_replica.py, or a script that never gets ready or fails to
load) since the model is not the point here."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from argosy_runtime.fleet import supervisor
from argosy_runtime.fleet.supervisor import Fleet, FleetConfig
from gateway_helpers import FAKE_REPLICA, FLAKY

# `argosy fleet ARGV[2:]` whose replicas run the script ARGV[1] instead of `argosy serve` (the
# same flags are passed to it).
FLEET_DRIVER = """
import sys
from argosy_runtime.fleet import replica_process
replica_process.DEFAULT_SERVE_COMMAND = (sys.executable, sys.argv[1])
from argosy_runtime.cli.main import main
sys.exit(main(["fleet", *sys.argv[2:]]))
"""

NEVER_READY = "import time\ntime.sleep(600)\n"  # a model that takes forever to load

def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_all(pids: set[int]) -> list[int]:
    """SIGKILL the ones still running (so no test leaves a process behind); returns them."""
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


class FleetCli:
    """`argosy fleet` as a subprocess, with every process it started remembered."""

    def __init__(self, replica_script: str, args: list[str], tmp_path: Path) -> None:
        self.stderr_path = tmp_path / "fleet.stderr"
        cmd = [sys.executable, "-c", FLEET_DRIVER, replica_script, "--log-dir",
               str(tmp_path / "logs"), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     stderr=open(self.stderr_path, "w"))  # noqa: SIM115
        self.children: set[int] = set()

    def watch_children(self, count: int, timeout: float = 20) -> None:
        """Wait until the fleet has started `count` replica processes."""
        deadline = time.monotonic() + timeout
        while len(self.children) < count:
            assert time.monotonic() < deadline, self.stderr()
            assert self.proc.poll() is None, self.stderr()
            self.children |= {c.pid for c in psutil.Process(self.proc.pid).children()}
            time.sleep(0.1)

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def close(self) -> list[int]:
        """Kill whatever is left; returns the pids that had outlived the fleet."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        return _kill_all(self.children)


@pytest.fixture
def fleet_cli(tmp_path: Path) -> Iterator:
    started: list[FleetCli] = []

    def start(replica_script: str, *args: str) -> FleetCli:
        started.append(FleetCli(replica_script, list(args), tmp_path))
        return started[-1]

    yield start
    for cli in started:
        cli.close()


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _stops_at_once(cli, sig: signal.Signals, when: str, code: int = 0) -> None:  # noqa: ANN001
    """Send `sig` to the fleet: it must exit with `code` within 15 s."""
    cli.proc.send_signal(sig)
    try:
        got = cli.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fleet did not stop on {sig.name} {when}")
    assert got == code, cli.stderr()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_replicas_load_stops_the_fleet_at_once(
        fleet_cli, tmp_path: Path, sig: signal.Signals) -> None:
    # Ctrl-C used to be held until every replica was ready (or the 300 s start-up timeout).
    cli = fleet_cli(_script(tmp_path, "never_ready.py", NEVER_READY), "--port", "0",
                    "--replicas", "2")
    cli.watch_children(2)
    # It never served: 128 + the signal, as a shell reports it (it was 0, a success)
    _stops_at_once(cli, sig, "while its replicas loaded", code=128 + sig)
    assert cli.close() == [], "replicas outlived the fleet"
    assert "Traceback" not in cli.stderr()
    assert "argosy fleet: interrupted while starting" in cli.stderr()


def test_a_busy_gateway_port_fails_before_any_replica_starts(fleet_cli, tmp_path: Path) -> None:
    # It used to load every replica, then die with an OSError traceback, leaving them running.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cli = fleet_cli(FAKE_REPLICA, "--port", str(port), "--replicas", "2")
        code = cli.proc.wait(timeout=30)
    stderr = cli.stderr()
    assert code == 2, stderr  # the user's option, as serve and gateway exit (it was 1)
    assert ("argosy fleet: error: "
            f"--host 127.0.0.1 --port {port}: cannot listen there") in stderr, stderr
    assert "Traceback" not in stderr
    assert not list((tmp_path / "logs").glob("replica-*.log")), "replicas were started"
    assert cli.close() == []


@pytest.mark.parametrize("flag", ["--port", "--host", "--model", "--served-model-name"])
def test_serve_args_cannot_override_what_the_fleet_sets(flag: str) -> None:
    # `-- --port 9000` made every replica listen on 9000 while the fleet polled the port it
    # chose: a 300 s wait for a replica that would never answer there.
    with pytest.raises(ValueError, match=f"{flag}.*set by the fleet"):
        FleetConfig(serve_args=("--kv-cache-memory", "64MiB", flag, "x"))
    with pytest.raises(ValueError, match=f"{flag}.*set by the fleet"):
        FleetConfig(serve_args=(f"{flag}=x",))
    assert FleetConfig(serve_args=("--kv-cache-memory", "64MiB")).serve_args


def test_the_cli_refuses_serve_args_the_fleet_sets() -> None:
    proc = subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", "fleet", "--",
                           "--port", "9000"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert ("argosy fleet: the arguments after --: --port is set by the fleet"
            in proc.stderr), proc.stderr


async def test_a_replacement_that_fails_to_start_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A dead replica's replacement that failed to load used to be given up on silently (an
    # unretrieved task exception): the fleet stayed a replica short for good.
    fail = tmp_path / "FAIL"
    monkeypatch.setenv("FAIL_IF_EXISTS", str(fail))
    flaky = _script(tmp_path, "flaky.py", FLAKY)
    fleet = Fleet(FleetConfig(model="tiny", replicas=2, port=0,
                              serve_command=(sys.executable, flaky), health_interval_s=0.2,
                              log_dir=str(tmp_path / "logs"), ready_timeout_s=30))
    await fleet.start()
    pids = {p.process.pid for p in fleet.processes}
    try:
        pool = fleet.gateway.pools["tiny"]
        fail.touch()  # from now on the model "does not load"
        await fleet.processes[0].kill()
        deadline = time.monotonic() + 20
        while caplog.text.count("cannot load the model") < 2:  # two failed tries, logged
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        assert len(pool.available()) == 1
        fail.unlink()  # loads again: the next try succeeds
        deadline = time.monotonic() + 20
        while len(pool.available()) < 2 or len(fleet.processes) != 2:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        pids |= {p.process.pid for p in fleet.processes}
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


# Ready at once, but ignores SIGTERM: a replica that does not drain.
STUBBORN = """
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _wait_until_serving(cli: FleetCli, replicas: int) -> None:
    line = cli.proc.stdout.readline()  # one line per replica, then the gateway's
    while "behind http://" not in line:
        assert line, cli.stderr()
        line = cli.proc.stdout.readline()
    cli.watch_children(replicas)


def test_sigterm_drains_every_replica_and_exits_0(fleet_cli) -> None:
    cli = fleet_cli(FAKE_REPLICA, "--port", "0", "--replicas", "2")
    _wait_until_serving(cli, 2)
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.proc.wait(timeout=20) == 0, cli.stderr()
    assert cli.close() == []
    assert "SIGKILL" not in cli.stderr()  # drained, not killed


def test_a_second_signal_kills_replicas_that_do_not_drain(fleet_cli, tmp_path: Path) -> None:
    # The first signal drains (up to 60 s per replica); a second one used to be ignored.
    cli = fleet_cli(_script(tmp_path, "stubborn.py", STUBBORN), "--port", "0", "--replicas", "2")
    _wait_until_serving(cli, 2)
    cli.proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert cli.proc.poll() is None  # still draining
    sent = time.monotonic()
    cli.proc.send_signal(signal.SIGINT)
    try:
        code = cli.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("a second signal did not stop the fleet")
    assert time.monotonic() - sent < 10
    assert code == 0, cli.stderr()
    assert cli.close() == [], "replicas outlived the fleet"


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_bad_gateway_port_is_refused_up_front(fleet_cli, tmp_path: Path, port: str) -> None:
    # 70000 used to start every replica, then die in a traceback; -1 blamed --host.
    cli = fleet_cli(FAKE_REPLICA, "--port", port)
    assert cli.proc.wait(timeout=30) == 2, cli.stderr()
    assert f"argosy fleet: --port: must be a TCP port (0-65535), got {port}" in cli.stderr()
    assert not list((tmp_path / "logs").glob("replica-*.log")), "replicas were started"


async def test_scale_down_drains_the_idle_replica_not_the_one_answering(tmp_path: Path) -> None:
    import aiohttp

    fleet = Fleet(FleetConfig(
        model="tiny", replicas=2, min_replicas=1, max_replicas=2, port=0,
        autoscaling={"scrapeIntervalSeconds": 0.3, "stableWindowSeconds": 1.5,
                     "panicWindowSeconds": 0.6, "scaleDownStabilizationSeconds": 0.5},
        serve_command=(sys.executable, FAKE_REPLICA), health_interval_s=0.15,
        log_dir=str(tmp_path), ready_timeout_s=30, drain_timeout_s=10))  # fmt: skip
    url = await fleet.start()
    pids = {p.process.pid for p in fleet.processes}
    try:
        async with aiohttp.ClientSession() as s:
            for proc in fleet.processes:  # a slow stream: 20 chunks, 0.25 s apart
                await s.post(f"{proc.url}/control", json={"chunk_delay": 0.25, "num_chunks": 20})
            body = {"model": "tiny", "prompt": "x", "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                busy = resp.headers["x-argosy-backend"]
                text = (await resp.read()).decode()
            # The fleet scaled down while the stream ran, draining the other replica.
            assert [p.url for p in fleet.processes] == [busy]
            assert text.count("data: ") == 21 and text.rstrip().endswith("[DONE]")
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


def test_a_log_dir_that_cannot_be_made_is_reported(tmp_path: Path) -> None:
    # It used to end in a FileExistsError traceback.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = subprocess.run([sys.executable, "-c", FLEET_DRIVER, FAKE_REPLICA, "--port", "0",
                           "--log-dir", str(a_file / "logs")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"argosy fleet: --log-dir {a_file / 'logs'}: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# fake_replica.py that first takes the port $SQUAT_PORT (another program taking the gateway's
# port while the replicas load); its pid goes to its log.
SQUATTER = f"""
import os, runpy, socket, sys
squat = socket.socket()
squat.bind(("127.0.0.1", int(os.environ["SQUAT_PORT"])))
squat.listen()
print("pid", os.getpid(), flush=True)
sys.argv[0] = {FAKE_REPLICA!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


async def test_a_gateway_port_taken_while_replicas_load_stops_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The OSError used to escape start(), leaving the loaded replicas running.
    from argosy_runtime.fleet.replica_process import free_port

    port = free_port()
    monkeypatch.setenv("SQUAT_PORT", str(port))
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=port, log_dir=str(tmp_path),
                              serve_command=(sys.executable, _script(tmp_path, "s.py", SQUATTER)),
                              ready_timeout_s=30))
    try:
        with pytest.raises(RuntimeError, match=f"cannot serve the gateway on 127.0.0.1:{port}"):
            await fleet.start()
    finally:
        (log,) = tmp_path.glob("replica-*.log")
        pid = int(log.read_text().split()[1])
        assert _kill_all({pid}) == [], "the replica outlived the failed start"
    assert not fleet.processes


# fake_replica.py; while the file named by $DIE_IF_EXISTS exists, it exits (code 3) about a
# second after it started: ready, then dead, like a model that loads but fails its first step.
DIES_SOON = f"""
import os, runpy, sys, threading, time
if os.path.exists(os.environ["DIE_IF_EXISTS"]):
    def die():
        time.sleep(2.0)  # after it is ready (1 s was too short on a loaded machine)
        print("fatal: CUDA error on the first step", flush=True)
        os._exit(3)
    threading.Thread(target=die, daemon=True).start()
sys.argv[0] = {FAKE_REPLICA!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


async def test_replicas_that_keep_crashing_after_start_are_restarted_with_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each replacement was started at once: a replica that crashed right after becoming ready
    # was restarted every ~2 s forever (each restart a model load, and a new log file).
    caplog.set_level(logging.INFO, logger="argosy_runtime.fleet")
    die = tmp_path / "DIE"
    monkeypatch.setenv("DIE_IF_EXISTS", str(die))
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, health_interval_s=0.2,
                              serve_command=(sys.executable, _script(tmp_path, "d.py", DIES_SOON)),
                              log_dir=str(tmp_path / "logs"), ready_timeout_s=30))
    await fleet.start()
    pids = {p.process.pid for p in fleet.processes}
    try:
        die.touch()
        await fleet.processes[0].kill()  # replaced at once: a crash is not yet a crash loop
        deadline = time.monotonic() + 20
        while "2 in a row" not in caplog.text:  # the replacement crashed too
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
            pids |= {p.process.pid for p in fleet.processes if p.process}
        assert "the next one starts in 2 s" in caplog.text
        # How each one ended, said plainly (it was "code -9" and an empty line).
        assert "exited (killed by SIGKILL); the end of its log" in caplog.text
        assert "exited (code 3); the end of its log" in caplog.text
        waited = time.monotonic()
        die.unlink()  # the next one lives
        while not fleet.gateway.pools["tiny"].available():
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        assert time.monotonic() - waited > 1.5, "restarted without waiting"
        pids |= {p.process.pid for p in fleet.processes}
        starts = [r for r in caplog.records if "starting (pid" in r.getMessage()]
        assert len(starts) == 3, caplog.text  # the first, the first replacement, this one
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


async def test_a_replacement_whose_log_cannot_be_written_is_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The OSError from opening its log (the log dir gone, a file in its place) ended the
    # replacement for good, and the replica that never ran stayed in fleet.processes: the
    # fleet stayed a replica short, and the autoscaler counted one that did not exist.
    logs = tmp_path / "logs"
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, health_interval_s=0.2,
                              serve_command=(sys.executable, FAKE_REPLICA),
                              log_dir=str(logs), ready_timeout_s=30))
    await fleet.start()
    pids = {p.process.pid for p in fleet.processes}
    try:
        for log in logs.iterdir():
            log.unlink()
        logs.rmdir()
        logs.write_text("")  # a file where the log dir was
        await fleet.processes[0].kill()
        deadline = time.monotonic() + 20
        while "could not start" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        assert "retrying in 1 s" in caplog.text
        assert fleet.processes == []
        logs.unlink()  # the next try makes the folder again
        while not fleet.gateway.pools["tiny"].available():
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        assert len(fleet.processes) == 1
        pids |= {p.process.pid for p in fleet.processes}
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


SLOW_START = f"""
import runpy, sys, time
time.sleep(30)  # a model that takes a while to load
sys.argv[0] = {FAKE_REPLICA!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_scaling_up_from_zero_stops_the_fleet_at_once(
        fleet_cli, tmp_path: Path, sig: signal.Signals) -> None:
    # The request held for the replica being started kept the gateway's drain waiting
    # (drain_timeout_s, 30 s), a second signal no help: the held request now gets its 503.
    cli = fleet_cli(_script(tmp_path, "slow.py", SLOW_START), "--port", "0", "--replicas", "0",
                    "--min", "0", "--max", "2", "--model", "tiny", "--autoscaling",
                    "{scrapeIntervalSeconds: 0.3, stableWindowSeconds: 1.5, "
                    "panicWindowSeconds: 0.6}")
    line = cli.proc.stdout.readline()
    assert "behind http://" in line, cli.stderr()
    url = line.split("behind ")[1].split()[0]
    answers: list[object] = []

    def held() -> None:
        request = urllib.request.Request(f"{url}/v1/completions", headers={
            "Content-Type": "application/json"}, data=b'{"model": "tiny", "prompt": "x"}')
        try:
            urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as exc:
            answers.append(exc.code)
        except OSError as exc:
            answers.append(exc)

    client = threading.Thread(target=held, daemon=True)
    client.start()
    cli.watch_children(1)  # the autoscaler is starting a replica for the held request
    _stops_at_once(cli, sig, "while a replica started for a held request")
    client.join(10)
    assert answers == [503]
    assert cli.close() == [], "replicas outlived the fleet"
    assert "Traceback" not in cli.stderr()


@pytest.mark.parametrize("failure", ["engine dead", "hung"])
async def test_a_replica_failing_its_liveness_check_is_killed_and_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        failure: str) -> None:
    """A ready replica whose /health answers 503 (its engine thread died: the process lives
    on) or does not answer at all (SIGSTOP: a hung process) for liveness_timeout_s is stopped
    (SIGTERM, SIGKILL after the grace period) and replaced; the other replica is left alone.
    The gateway had already taken a hung one out of rotation, but only this puts the fleet
    back to two replicas."""
    import aiohttp

    monkeypatch.setattr(supervisor, "LIVENESS_KILL_GRACE_S", 1.0)
    caplog.set_level(logging.WARNING, logger="argosy_runtime.fleet")
    fleet = Fleet(FleetConfig(model="tiny", replicas=2, port=0,
                              serve_command=(sys.executable, FAKE_REPLICA), health_interval_s=0.2,
                              liveness_timeout_s=1.0, log_dir=str(tmp_path), ready_timeout_s=30))
    await fleet.start()
    sick, well = fleet.processes
    pids = {sick.process.pid, well.process.pid}
    try:
        if failure == "hung":
            os.kill(sick.process.pid, signal.SIGSTOP)
        else:
            async with aiohttp.ClientSession() as s:
                await s.post(f"{sick.url}/control", json={"healthy": False})
        deadline = time.monotonic() + 20
        while sick in fleet.processes or len(fleet.processes) != 2 or not all(
                p.ready for p in fleet.processes):
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        # A live process drains on SIGTERM (exit 0); a stopped one cannot: SIGKILL.
        assert sick.process.returncode == (0 if failure == "engine dead" else -signal.SIGKILL)
        assert well in fleet.processes and well.process.returncode is None
        assert f"replica {sick.url} has failed its liveness check" in caplog.text
        pool = fleet.gateway.pools["tiny"]
        deadline = time.monotonic() + 10
        while len(pool.available()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        pids |= {p.process.pid for p in fleet.processes}
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


# Ready, /health always 503 (a dead engine), ignores SIGTERM (prints when it gets one), and
# has started a child process that outlives it unless killed with it: a replica's
# tensor-parallel worker. Prints the child's pid.
UNHEALTHY_WITH_A_WORKER = """
import http.server, signal, subprocess, sys
def on_sigterm(*_):
    print("SIGTERM ignored", flush=True)
signal.signal(signal.SIGTERM, on_sigterm)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("worker pid", worker.pid, flush=True)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


async def _liveness_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """Start a fleet of one UNHEALTHY_WITH_A_WORKER replica (not replaced), wait until it has
    exited; returns it, when the fleet saw it exit (time.time()), its worker's pid."""
    monkeypatch.setattr(supervisor, "LIVENESS_KILL_GRACE_S", 1.0)
    script = _script(tmp_path, "unhealthy.py", UNHEALTHY_WITH_A_WORKER)
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, restart=False,
                              serve_command=(sys.executable, script), health_interval_s=0.2,
                              liveness_timeout_s=1.0, log_dir=str(tmp_path), ready_timeout_s=30))
    await fleet.start()
    (sick,) = fleet.processes
    worker, left = None, []
    try:
        deadline = time.monotonic() + 20
        while sick.alive:
            if worker is None and "worker pid" in sick.log_tail():
                worker = int(sick.log_tail().split("worker pid ")[1].split()[0])
            assert time.monotonic() < deadline, sick.log_tail()
            await asyncio.sleep(0.02)
        exited_at = time.time()
        if worker is None:
            worker = int(sick.log_tail().split("worker pid ")[1].split()[0])
    finally:
        await fleet.stop()
        if worker is not None:
            await asyncio.sleep(0.5)  # a SIGKILL is delivered, not waited for
            left = _kill_all({worker})
    return sick, exited_at, left


async def test_a_replica_that_ignores_sigterm_is_killed_after_the_grace_period(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The liveness kill was a SIGKILL at once: the replica could not log or let go of its
    workers. Now SIGTERM first; one that ignores it (or cannot act on it) is SIGKILLed once
    the grace period (1 s here) has passed."""
    caplog.set_level(logging.INFO, logger="argosy_runtime.fleet")
    sick, exited_at, _ = await _liveness_kill(tmp_path, monkeypatch)
    assert sick.process.returncode == -signal.SIGKILL
    assert "SIGTERM ignored" in sick.log_tail(), sick.log_tail()
    sigterm = f"replica {sick.url} (pid {sick.process.pid}): SIGTERM (its liveness check failed)"
    (sent,) = [r for r in caplog.records if r.getMessage() == sigterm]
    assert exited_at - sent.created >= 1.0  # the grace period
    assert f"replica {sick.url} has failed its liveness check" in caplog.text
    assert (f"replica {sick.url} (pid {sick.process.pid}) did not exit within 1 s of SIGTERM "
            "(its liveness check failed): SIGKILL to its process group") in caplog.text


async def test_a_replica_killed_for_liveness_leaves_no_worker_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain SIGKILL of the replica left its child processes (tensor-parallel workers)
    running, orphaned; its whole process group is killed now."""
    sick, _, left = await _liveness_kill(tmp_path, monkeypatch)
    assert sick.process.returncode == -signal.SIGKILL
    assert left == [], "the replica's worker outlived it"


async def test_a_fleet_stopped_while_a_hung_replica_is_being_killed_does_not_drain_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopping the fleet inside a liveness kill's grace period cancels that kill: the hung
    replica (it ignores SIGTERM) is then killed at once, not drained, which would hold the
    fleet's exit for drain_timeout_s (20 s here)."""
    monkeypatch.setattr(supervisor, "LIVENESS_KILL_GRACE_S", 30.0)
    script = _script(tmp_path, "unhealthy.py", UNHEALTHY_WITH_A_WORKER)
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, restart=False,
                              serve_command=(sys.executable, script), health_interval_s=0.2,
                              liveness_timeout_s=1.0, drain_timeout_s=20.0,
                              log_dir=str(tmp_path), ready_timeout_s=30))
    await fleet.start()
    (sick,) = fleet.processes
    try:
        deadline = time.monotonic() + 20
        while "SIGTERM ignored" not in sick.log_tail():  # the liveness kill has begun
            assert time.monotonic() < deadline, sick.log_tail()
            await asyncio.sleep(0.05)
        worker = int(sick.log_tail().split("worker pid ")[1].split()[0])
    finally:
        started = time.monotonic()
        await fleet.stop()
        stopped_in = time.monotonic() - started
    assert stopped_in < 10, stopped_in
    assert sick.process.returncode == -signal.SIGKILL
    await asyncio.sleep(0.5)  # a SIGKILL is delivered, not waited for
    assert _kill_all({worker}) == [], "the replica's worker outlived it"


EXITS_CLEANLY_WITH_A_TRACKER = r"""
import http.server, os, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
# Like multiprocessing's resource tracker: notices its parent is gone, cleans up for a
# moment (0.3 s), and leaves a mark.
tracker = subprocess.Popen([sys.executable, "-c", (
    "import os, sys, time\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent: time.sleep(0.02)\n"
    "time.sleep(0.3)\n"
    "open(sys.argv[1], 'w').write('cleaned up')\n"), sys.argv[1]])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
server.serve_forever()
"""


async def test_what_a_replica_leaves_to_clean_up_after_a_clean_exit_is_not_killed(
        tmp_path: Path) -> None:
    """A drained replica exits 0; a process of its group that cleans up after it (a
    resource tracker removing its workers' shared memory) gets a moment to finish before
    the rest of the group is SIGKILLed."""
    mark = tmp_path / "mark"
    script = _script(tmp_path, "clean.py", EXITS_CLEANLY_WITH_A_TRACKER)
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, restart=False,
                              serve_command=(sys.executable, script, str(mark)),
                              log_dir=str(tmp_path), ready_timeout_s=30))
    await fleet.start()
    (replica,) = fleet.processes
    await fleet.stop()
    assert replica.process.returncode == 0
    assert mark.read_text() == "cleaned up"


@pytest.mark.parametrize("seconds", [-1, 0.2, float("nan")])
def test_a_liveness_timeout_below_a_second_is_refused(seconds: float) -> None:
    # Under a second an ordinary pause would kill healthy replicas.
    with pytest.raises(ValueError, match="liveness_timeout"):
        FleetConfig(liveness_timeout_s=seconds)
    assert FleetConfig(liveness_timeout_s=0).liveness_timeout_s == 0  # off


async def test_failed_scale_ups_back_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue asks for a second replica whose model no longer loads: each failed scale-up
    doubles the wait before the next (1, 2, 4 s), where the autoscaler used to start one
    every tick. Once it loads again, the scale-up happens and the count resets."""
    import aiohttp

    caplog.set_level(logging.INFO, logger="argosy_runtime.fleet")
    fail = tmp_path / "FAIL"
    monkeypatch.setenv("FAIL_IF_EXISTS", str(fail))
    flaky = _script(tmp_path, "flaky.py", FLAKY)
    fleet = Fleet(FleetConfig(
        model="tiny", replicas=1, min_replicas=1, max_replicas=2, port=0,
        autoscaling={"scrapeIntervalSeconds": 0.2, "stableWindowSeconds": 1.0,
                     "panicWindowSeconds": 0.4},
        serve_command=(sys.executable, flaky), health_interval_s=0.15,
        log_dir=str(tmp_path / "logs"), ready_timeout_s=30))  # fmt: skip
    await fleet.start()
    pids = {p.process.pid for p in fleet.processes}
    try:
        fail.touch()
        async with aiohttp.ClientSession() as s:
            await s.post(f"{fleet.processes[0].url}/control", json={"num_waiting": 50})
        await asyncio.sleep(5.0)
        failed = caplog.text.count("autoscaler: scale-up failed")
        assert 1 <= failed <= 3, caplog.text  # at ~0, ~1 and ~3 s at the earliest
        assert "holding the scale-up" in caplog.text
        # Held ticks decide nothing: the history holds the scale-ups tried, not one per tick.
        assert sum(1 for d in fleet.decisions if d.changed) <= failed + 1
        fail.unlink()
        deadline = time.monotonic() + 20
        while len(fleet.gateway.pools["tiny"].available()) < 2:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        assert fleet._failed_scale_ups == 0  # noqa: SLF001
        pids |= {p.process.pid for p in fleet.processes}
    finally:
        await fleet.stop()
    assert _kill_all(pids) == []


async def test_a_replica_whose_port_was_taken_starts_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fleet picks a free port and the replica binds it later: another process may take
    it in between (here one listens on the first port handed out). That replica used to fail
    the whole start-up; it starts again on another port."""
    from argosy_runtime.fleet import supervisor
    from argosy_runtime.fleet.replica_process import free_port

    caplog.set_level(logging.WARNING, logger="argosy_runtime.fleet.supervisor")
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(supervisor, "free_port", lambda: next(ports, None) or free_port())
    fleet = Fleet(FleetConfig(model="tiny", replicas=1, port=0, health_interval_s=0.2,
                              serve_command=(sys.executable, FAKE_REPLICA),
                              log_dir=str(tmp_path), ready_timeout_s=30))
    try:
        await fleet.start()
        pids = {p.process.pid for p in fleet.processes}
        assert [p.port for p in fleet.processes] != [taken] and len(fleet.processes) == 1
        assert f"replica http://127.0.0.1:{taken} could not listen" in caplog.text
        assert len(fleet.gateway.pools["tiny"].available()) == 1
    finally:
        await fleet.stop()
        squatter.close()
    assert _kill_all(pids) == []
