"""The worker processes of a tensor-parallel engine (real spawned processes): they never
outlive the engine process, whatever they are doing when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from process_helpers import is_running  # noqa: E402

pytestmark = pytest.mark.slow  # spawns worker processes, each importing torch


# An engine process (rank 0) whose two workers take "forever" to load their shards: the
# module-level patch runs in the workers too (spawn imports this script as __mp_main__).
SLOW_LOADING_ENGINE = textwrap.dedent("""
    import time

    import torch
    import argosy_runtime.distributed.workers as workers

    def slow_load(config, rank):  # a large model on a slow disk
        time.sleep(600)

    workers.build_rank_model = slow_load

    if __name__ == "__main__":
        w = workers.TensorParallelWorkers(workers.WorkerConfig(
            model="unused", hf_overrides=None, dtype=torch.float32, device_type="cpu",
            max_model_len=16, quant_config=None, cpu_threads=1, world_size=3,
            kv_cache_memory_fraction=0.5))
        print(" ".join(str(p.pid) for p in w._procs), flush=True)
        time.sleep(600)
""")


def test_workers_exit_when_the_engine_process_is_killed_while_they_load(tmp_path: Path) -> None:
    # Killed outright (SIGKILL, the OOM killer): no close() runs. The workers only noticed
    # once their load was over (they then wrote to the closed pipe): minutes of a large
    # model's memory (or GPU memory) held by orphans.
    script = tmp_path / "engine.py"
    script.write_text(SLOW_LOADING_ENGINE)
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 2, pids
        time.sleep(1.0)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 30  # a worker still importing torch exits once it is done
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if is_running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "tensor-parallel workers outlived their engine process"
