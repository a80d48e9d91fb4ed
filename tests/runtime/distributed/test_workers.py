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


def _run_engine_script(tmp_path: Path, text: str, timeout: float = 240) -> str:
    """Run `text` as an engine process (its workers import it as __mp_main__); its output.
    Fails the test, killing the script's whole process group, if it outlives `timeout`."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(text))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the engine script did not finish in {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _printed_pids(out: str) -> list[int]:
    """The worker pids an engine script printed on its "pids ..." line."""
    line = next(line for line in out.splitlines() if line.startswith("pids"))
    return [int(p) for p in line.split()[1:]]


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if is_running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "tensor-parallel workers left running"


def test_a_later_rank_that_fails_to_load_is_reported_while_an_earlier_one_loads(
        tmp_path: Path) -> None:
    # wait_ready read the workers in rank order: rank 2's error waited for rank 1 to load
    # its shard (here forever; minutes for a large model).
    out = _run_engine_script(tmp_path, """
        import time

        import torch
        import argosy_runtime.distributed.workers as workers

        def build_rank_model(config, rank):
            if rank == 2:
                raise MemoryError("rank 2 cannot hold its shard")
            time.sleep(600)  # rank 1: a large model on a slow disk

        workers.build_rank_model = build_rank_model

        if __name__ == "__main__":
            w = workers.TensorParallelWorkers(workers.WorkerConfig(
                model="unused", hf_overrides=None, dtype=torch.float32, device_type="cpu",
                max_model_len=16, quant_config=None, cpu_threads=1, world_size=3,
                kv_cache_memory_fraction=0.5))
            print("pids", *(p.pid for p in w._procs), flush=True)
            try:
                w.wait_ready()
            except RuntimeError as exc:
                print("error:", exc, flush=True)
            w.close(timeout=2)
    """, timeout=180)
    assert "argosy-tp-rank2 failed" in out and "rank 2 cannot hold its shard" in out, out
    _assert_gone(_printed_pids(out))


def test_a_worker_failing_mid_step_raises_its_own_traceback_on_rank_0(tmp_path: Path) -> None:
    # Rank 0 saw only gloo's "Connection closed by peer"; the worker's error was on stderr
    # among the other ranks' output (rank 1 added a traceback of gloo's error of its own).
    sys_path = str(Path(__file__).resolve().parents[1])  # tests/runtime: model_factory
    out = _run_engine_script(tmp_path, f"""
        import multiprocessing
        import sys
        import tempfile
        from pathlib import Path

        import argosy_runtime.model_runner as model_runner

        if __name__ == "__mp_main__":  # a worker
            forward = model_runner.ModelRunner.forward
            steps = [0]

            def failing_forward(self, *args, **kwargs):
                steps[0] += 1
                if multiprocessing.current_process().name == "argosy-tp-rank2" and steps[0] == 2:
                    raise MemoryError("rank 2 ran out of memory in step 2")
                return forward(self, *args, **kwargs)

            model_runner.ModelRunner.forward = failing_forward

        if __name__ == "__main__":
            sys.path.insert(0, {sys_path!r})
            from model_factory import make_random_model_dir

            from argosy_runtime import LLMEngine, SamplingParams

            folder = make_random_model_dir(Path(tempfile.mkdtemp(dir={str(tmp_path)!r})),
                                           hidden_size=96, intermediate_size=192,
                                           num_attention_heads=6, num_key_value_heads=3)
            engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=3)
            print("pids", *(p.pid for p in engine.tensor_parallel_workers._procs), flush=True)
            engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            except RuntimeError as exc:
                print("step error:", exc, flush=True)
            engine.shutdown()
    """)
    error = out[out.index("step error:"):]
    assert "argosy-tp-rank2 failed" in error, out
    assert "MemoryError: rank 2 ran out of memory in step 2" in error, out
    assert "Connection closed" not in out, out  # neither rank 0's nor rank 1's gloo error
    _assert_gone(_printed_pids(out))


def test_a_rank_that_cannot_be_started_stops_the_ones_before_it(tmp_path: Path) -> None:
    # Rank 2's start failed (here: out of file descriptors): the constructor raised, nobody
    # held the object to close it, and rank 1 went on loading its shard until the engine
    # process exited.
    out = _run_engine_script(tmp_path, """
        import errno
        import multiprocessing
        import time
        from multiprocessing.context import SpawnProcess

        import torch
        import argosy_runtime.distributed.workers as workers

        def slow_load(config, rank):  # a large model on a slow disk
            time.sleep(600)

        workers.build_rank_model = slow_load

        if __name__ == "__main__":
            start = SpawnProcess.start

            def start_but_rank_2(self):
                if self.name == "argosy-tp-rank2":
                    raise OSError(errno.EMFILE, "Too many open files")
                start(self)

            SpawnProcess.start = start_but_rank_2
            try:
                workers.TensorParallelWorkers(workers.WorkerConfig(
                    model="unused", hf_overrides=None, dtype=torch.float32,
                    device_type="cpu", max_model_len=16, quant_config=None, cpu_threads=1,
                    world_size=3, kv_cache_memory_fraction=0.5))
            except OSError as exc:
                print("error:", exc, flush=True)
            time.sleep(1.0)
            left = multiprocessing.active_children()
            print("left", *(p.pid for p in left), flush=True)
            for p in left:  # the test's own clean-up
                p.kill()
    """, timeout=120)
    assert "error: [Errno 24] Too many open files" in out, out
    assert next(line for line in out.splitlines() if line.startswith("left")) == "left", out


def test_argosy_serve_reports_a_worker_that_fails_to_load_in_one_error(tmp_path: Path) -> None:
    # `argosy serve --tensor-parallel-size 2` whose rank 1 cannot load its shard: the
    # worker's traceback buried under rank 0's own (through the loading thread and
    # wait_ready), ending in a bare RuntimeError. Now: one logged error that holds the
    # worker's traceback, and exit code 1.
    sys_path = str(Path(__file__).resolve().parents[1])  # tests/runtime: model_factory
    out = _run_engine_script(tmp_path, f"""
        import sys
        import tempfile
        from pathlib import Path

        import argosy_runtime.distributed.workers as workers

        if __name__ == "__mp_main__":  # a worker
            def build_rank_model(config, rank):
                raise OSError("rank 1 cannot read its shard")

            workers.build_rank_model = build_rank_model

        if __name__ == "__main__":
            sys.path.insert(0, {sys_path!r})
            from model_factory import make_random_model_dir

            from argosy_runtime.cli.main import main

            folder = make_random_model_dir(Path(tempfile.mkdtemp(dir={str(tmp_path)!r})))
            code = main(["serve", "--model", str(folder), "--dtype", "float32",
                         "--tensor-parallel-size", "2", "--port", "0"])
            print("exit code", code, flush=True)
    """, timeout=180)
    assert "exit code 1" in out, out
    assert "ERROR argosy.server cannot load the model: tensor-parallel worker " \
           "argosy-tp-rank1 failed:" in out, out
    assert "OSError: rank 1 cannot read its shard" in out, out
    assert out.count("Traceback (most recent call last)") == 1, out  # the worker's only
