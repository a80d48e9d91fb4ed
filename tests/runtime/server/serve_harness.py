"""Start and inspect real `argosy serve` processes on loopback ports (used by conftest.py).

The main server runs the embedded smollm2-135m in float32 so that its greedy texts equal the
offline `LLM.generate` texts. Loading the model takes tens of seconds on a shared CPU, so each
server is started once per session (or module) and shared.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 300.0
# The servers' logs live for the test session (tests read them after a server stopped) and go
# with it: the folder is removed when the interpreter exits.
_LOGS = tempfile.TemporaryDirectory(prefix="argosy-serve-logs-")


BATCH_DONE = ("completed", "failed", "cancelled", "expired")


def wait_for_batch(client: Any, batch_id: str, until: Callable[[Any], bool] | None = None,
                   timeout: float = 300.0) -> Any:
    """Poll `client.batches.retrieve` (an `openai.OpenAI`) until `until(batch)`, by default
    until the batch reached a final status; the batch then."""
    until = until or (lambda b: b.status in BATCH_DONE)
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `argosy serve` subprocess; `url` is its base URL once `wait_ready()` returned."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="argosy-serve-", suffix=".log",
                                                dir=_LOGS.name)[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "argosy_runtime.cli.main", "serve", "--model", MODEL,
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(self.port),
               "--kv-cache-memory", "256MiB", "--max-model-len", "2048", *extra]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"argosy serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"argosy serve not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: 'name' -> value (labels dropped, last one wins)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                values[m.group(1)] = float(m.group(3))
        return values

    def running_and_kv(self) -> tuple[float, float]:
        """(requests running, KV-cache usage) from /metrics."""
        m = self.metrics()
        return m["argosy:num_requests_running"], m["argosy:kv_cache_usage_perc"]

    def assert_back_to_idle(self, idle_kv: float, within: float) -> None:
        """Within `within` seconds nothing runs and the KV usage is back to `idle_kv`: an
        aborted request freed every block."""
        deadline = time.monotonic() + within
        while True:
            running, kv = self.running_and_kv()
            if (running, kv) == (0, idle_kv) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (running, kv) == (0, idle_kv), f"still {running} running, kv {kv} (idle {idle_kv})"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
