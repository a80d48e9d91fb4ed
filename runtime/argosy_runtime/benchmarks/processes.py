"""Server processes for the benchmark scripts in bench/: start one, wait until it answers, stop
it with everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


def start_process(cmd: list[str], log: Path, ready_url: str,
                  timeout: float = 600) -> subprocess.Popen:
    """Run `cmd` in a session of its own (output to `log`) until `ready_url` answers 200;
    RuntimeError if it exits first, TimeoutError (after stopping it) if it never answers."""
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_process(proc)
    raise TimeoutError(log.read_text()[-3000:])


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM the process's session (a server drains), SIGKILL it after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
