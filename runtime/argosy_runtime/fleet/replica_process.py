"""One `argosy serve` process on a loopback port, started and drained by the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from argosy_runtime.fleet.exit_with_parent import (
    DEFAULT_GRACE_S,
    EXIT_WITH_PARENT_ENV,
    EXIT_WITH_PARENT_GRACE_ENV,
)

logger = logging.getLogger(__name__)


DEFAULT_SERVE_COMMAND = (sys.executable, "-m", "argosy_runtime.cli.main", "serve")
# After a replica exits, how long what is left of its process group may take to exit by itself.
GROUP_EXIT_GRACE_S = 1.0
# How much of the end of a replica's log `log_tail` reads.
LOG_TAIL_BYTES = 64 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ReplicaProcess:
    """A runtime server subprocess: `start`, `wait_ready`, `drain` (SIGTERM), `kill`.

    Its output goes to `log_path` (a pipe nobody reads would fill and stall the server). It
    runs in a process group of its own (pgid = its pid) that the processes it starts join
    (the tensor-parallel workers): `kill` SIGKILLs the whole group, so none is left behind,
    blocked on a parent that is gone.
    """

    def __init__(
        self,
        model: str,
        served_model_name: str,
        port: int,
        *,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        log_dir: str | Path | None = None,
        serve_command: Sequence[str] | None = None,
        orphan_grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.model = model
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.extra_args = list(extra_args)
        # The program that serves: `argosy serve` in this interpreter unless told otherwise
        # (tests substitute a light server speaking the same flags and endpoints).
        self.serve_command = list(serve_command or DEFAULT_SERVE_COMMAND)
        self.log_path = Path(log_dir or ".") / f"replica-{port}.log"
        # Should this process die without draining it, how long the replica may take to
        # drain on its own before it kills itself (exit_with_parent.py).
        self.orphan_grace_s = orphan_grace_s
        # Where this start's output begins in `log_path`: a log is appended to by every
        # replica that ran on this port (in this fleet or an earlier one with this log dir),
        # and `log_tail` must not show an earlier one's last words as this one's.
        self.log_start = 0
        self.process: asyncio.subprocess.Process | None = None
        self.ready = False  # has answered /ready once (until then its start-up is in charge)
        self.ready_at: float | None = None  # time.monotonic() when it first answered /ready
        self.draining = False  # being drained: taken out of the fleet, not to be replaced
        self.stopping = False  # SIGTERM sent (`terminate`): it is exiting or about to be killed
        # SIGTERM has gone out once: never again, since `argosy serve` takes a second SIGTERM
        # during its drain as "exit at once", cutting the requests the first one let finish
        # (a fleet stopped while the autoscaler drains a replica would send it one more).
        self._sigterm_sent = False
        # time.monotonic() of the first of the liveness checks it is failing in a row, or None
        self.failing_since: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            *self.serve_command,
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it open)
        try:
            self.log_start = log.seek(0, os.SEEK_END)
            self.process = await asyncio.create_subprocess_exec(
                *self.command,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env=_replica_env(self.orphan_grace_s),
                start_new_session=True,  # a process group of its own, for `kill`
            )
        finally:
            log.close()
        logger.info("replica %s starting (pid %d, log %s)", self.url, self.process.pid, self.log_path)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait_ready(self, timeout: float = 300.0) -> bool:
        """Poll /ready until 200; False when the process exits or `timeout` passes."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline and self.alive:
                try:
                    async with session.get(
                        f"{self.url}/ready", timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        if resp.status == 200:
                            self.ready, self.ready_at = True, time.monotonic()
                            return True
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.25)
        return False

    async def drain(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server stops taking work, finishes what runs, exits 0); SIGKILL after
        `timeout`. Returns the exit code."""
        if self.process is None:
            return None
        self.draining = True
        return await self.terminate(timeout, "draining it")

    async def terminate(self, grace: float, why: str) -> int | None:
        """SIGTERM to the server (it can log, finish or give up what runs, and stop its
        workers itself); if it has not exited `grace` seconds later, SIGKILL to its whole
        process group (`kill`). Whatever of the group outlives it is killed too. Returns the
        exit code; `why` is for the log."""
        if self.process is None:
            return None
        self.stopping = True
        if self.process.returncode is None and not self._sigterm_sent:
            self._sigterm_sent = True
            logger.info("replica %s (pid %d): SIGTERM (%s)", self.url, self.process.pid, why)
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.process.wait(), grace)
        except TimeoutError:
            logger.warning("replica %s (pid %d) did not exit within %g s of SIGTERM (%s): "
                           "SIGKILL to its process group", self.url, self.process.pid, grace, why)
            return await self.kill()
        await self._kill_group_left_behind()
        return code

    async def kill(self) -> int | None:
        """SIGKILL to its whole process group, no draining. Returns the exit code."""
        if self.process is None:
            return None
        self.kill_group()
        return await self.process.wait()

    async def _kill_group_left_behind(self, grace: float = GROUP_EXIT_GRACE_S) -> None:
        """After the replica exited: what is left of its group gets `grace` seconds to exit
        by itself (a multiprocessing resource tracker removing the shared memory of its
        workers), then SIGKILL (a worker it left behind)."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)  # the group still has a process?
            except (ProcessLookupError, PermissionError):
                return
            await asyncio.sleep(0.05)
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL now to the replica and every process of its group (its workers)."""
        if self.process is None:
            return
        # Its pgid is its pid (start_new_session), and stays taken while any process of the
        # group lives, even after the replica itself has exited and been reaped. (Not
        # self.process.kill() as well: Popen polls first, and reaping the replica there
        # would leave asyncio's child watcher to report exit code 255.)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(self.process.pid, signal.SIGKILL)

    def log_tail(self, n: int = 20, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The last `n` lines this start wrote to its log, from its last `max_bytes` only:
        this runs on the event loop the gateway serves from, and a log grows without bound
        (appended to across restarts on one port)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                ours = self.log_start if self.log_start <= size else 0  # truncated since
                start = max(ours, size - max_bytes)
                f.seek(start)
                data = f.read(max_bytes)
        except OSError:
            return ""
        lines = data.decode(errors="replace").splitlines()
        if start > ours and len(lines) > 1:
            lines = lines[1:]  # the first is likely cut
        return "\n".join(lines[-n:])


def _replica_env(orphan_grace_s: float = DEFAULT_GRACE_S) -> dict[str, str]:
    """A replica's environment. It exits with this process (exit_with_parent.py). The
    replicas of one fleet share this machine's cores. OpenMP threads spin between parallel
    regions by default, which is fastest for a process alone on its cores (2x at batch 8 here)
    but lets busy neighbours starve each other (8-20x slower steps measured with two processes
    on 2 cores), so replicas wait passively unless the user chose otherwise."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", EXIT_WITH_PARENT_ENV: str(os.getpid()),
           EXIT_WITH_PARENT_GRACE_ENV: str(orphan_grace_s)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env
