"""The worker processes of a tensor-parallel engine: ranks 1..N-1.

The engine process is rank 0: it schedules, runs its own shard of the model, samples. Each
worker process loads its shard, then follows rank 0 step by step: rank 0 sends it every step's
batch (which tokens of which sequences, into which KV blocks) over a pipe, and both run the
same forward, meeting at the all-reduces. Workers never sample and never see requests.

Lifecycle: `launch` starts the workers, which load their shards while rank 0 loads its own;
`wait_ready` collects their KV-cache budgets (or raises the first worker's error); `connect`
joins the all-reduce group; `allocate` sizes every rank's KV cache alike; `run_step` per step;
`close` stops them. A worker whose engine process dies exits at once, whatever it is doing
(`_exit_with_engine_process`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from argosy_runtime.config import CacheConfig
from argosy_runtime.distributed.tensor_parallel import (
    CollectiveError,
    ShardedCheckpoint,
    TensorParallelGroup,
)

logger = logging.getLogger("argosy.engine")


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank builds its shard from (picklable: sent to the spawned workers)."""

    model: str
    hf_overrides: dict | None
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda": rank r runs on cuda:r
    max_model_len: int
    quant_config: Any  # a QuantizationConfig or None
    cpu_threads: int  # intra-op threads of each rank
    world_size: int
    kv_cache_memory_fraction: float  # CUDA: the share of free memory the KV cache may take


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def kv_cache_budget(device: torch.device, fraction: float) -> int | None:
    """Bytes this rank can give its KV cache once its weights are loaded (CUDA), None on a
    CPU (the engine's configured budget applies to every rank)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction)


def build_rank_model(config: WorkerConfig, rank: int) -> Any:
    """Rank `rank`'s shard of the model, weights loaded, on its device."""
    from argosy_runtime.model_loader import load_checkpoint
    from argosy_runtime.models.build import build_model

    checkpoint = ShardedCheckpoint(load_checkpoint(config.model, config.hf_overrides), rank,
                                   config.world_size)
    return build_model(checkpoint, config.dtype, rank_device(config.device_type, rank),
                       config.max_model_len, config.quant_config)


def _exit_with_engine_process() -> None:
    """Exit this worker as soon as the engine process (its parent) is gone.

    Killed outright (SIGKILL, the OOM killer), the engine runs no `close`, and a worker only
    saw its pipe close when it next used it: one loading its shard held the model's memory
    (or a GPU's) for as long as the load took. Not PR_SET_PDEATHSIG: Linux sends that when
    the parent *thread* exits, and the workers are started from a short-lived loading thread.
    The parent's sentinel is a pipe whose write end only the engine process holds."""
    multiprocessing.parent_process().join()  # type: ignore[union-attr]
    os._exit(1)


def _worker_main(rank: int, config: WorkerConfig, port: int, conn: Connection,
                 progress: Any) -> None:
    threading.Thread(target=_exit_with_engine_process, name="argosy-tp-parent-watch",
                     daemon=True).start()
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        torch.set_num_threads(config.cpu_threads)
        device = rank_device(config.device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build_rank_model(config, rank)
        conn.send(("ready", kv_cache_budget(device, config.kv_cache_memory_fraction)))
        group = TensorParallelGroup(rank, config.world_size, "127.0.0.1", port, device)
        group.progress = progress
        model.use_tensor_parallel(group)
        kind, cache_config = conn.recv()
        if kind == "stop":  # the engine failed to start after the shards loaded
            return
        from argosy_runtime.model_runner import ModelRunner

        runner = ModelRunner(model, cache_config, None, device, model.spec.vocab_size,
                             max_model_len=config.max_model_len)
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            runner.forward(payload)
            progress[1] += 1  # steps done
    except EOFError:  # the engine process is gone
        return
    except CollectiveError:
        # Another rank failed first and reports its own error: this one's (gloo's closed
        # connection) would only hide it. No traceback; exit code 1.
        sys.exit(1)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:  # the engine process is gone: the traceback goes to stderr here
            raise
        # Rank 0 raises it (WorkerFailed) with this traceback: printed once there, not also
        # here by multiprocessing above it.
        sys.exit(1)


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker failed (its traceback in the message) or exited."""


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes (ranks 1..N-1)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.store, self.port = TensorParallelGroup.listen(config.world_size)
        ctx = multiprocessing.get_context("spawn")  # fork would copy rank 0's threads and CUDA
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        # Per worker, written by it: [all-reduces started, steps done] (`_check_in_step`).
        self._progress = [ctx.Array("q", 2, lock=False) for _ in range(1, config.world_size)]
        self._steps_sent = 0
        self.broken: str | None = None  # why no more steps can run, once that is so
        self.group: TensorParallelGroup | None = None
        self._closed = False
        try:
            for rank in range(1, config.world_size):
                ours, theirs = ctx.Pipe()
                self._conns.append(ours)
                proc = ctx.Process(target=_worker_main,
                                   args=(rank, config, self.port, theirs, self._progress[rank - 1]),
                                   name=f"argosy-tp-rank{rank}", daemon=True)
                try:
                    proc.start()
                finally:
                    theirs.close()
                self._procs.append(proc)
        except BaseException:
            # A rank that cannot be started (out of file descriptors or processes): nobody
            # holds this object to close it, so the ranks already started would load their
            # shards (a large model's memory) for nothing until this process exits.
            self.close(timeout=0.0)
            raise

    def _receive(self, conn: Connection, proc: Any, expected: str) -> Any:
        """The next message of one worker, which must be `expected`: WorkerFailed carrying
        the worker's traceback if it failed or died instead."""
        exited = (f"tensor-parallel worker {proc.name} exited before it was {expected} (its "
                  "error is on stderr; a script that starts an engine with "
                  "tensor_parallel_size > 1 must do it under `if __name__ == '__main__':`, "
                  "since the workers are spawned processes that import the script)")
        while not conn.poll(0.1):
            if not proc.is_alive():
                raise WorkerFailed(exited)
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise WorkerFailed(exited) from None
        if kind == "error":
            raise WorkerFailed(f"tensor-parallel worker {proc.name} failed:\n{payload}")
        return payload

    def wait_ready(self) -> list[int | None]:
        """Each worker's KV-cache budget in bytes (None on CPUs) once its shard is loaded.
        Watches every worker at once: one that fails (or dies) raises its error as soon as it
        does, not once the ranks before it have loaded (minutes for a large model)."""
        budgets: dict[int, int | None] = {}
        while len(budgets) < len(self._procs):
            waiting = [i for i in range(len(self._procs)) if i not in budgets]
            # A message, or a worker's exit (its sentinel), wakes this up.
            multiprocessing.connection.wait(
                [self._conns[i] for i in waiting] + [self._procs[i].sentinel for i in waiting])
            for i in waiting:
                if self._conns[i].poll() or not self._procs[i].is_alive():
                    budgets[i] = self._receive(self._conns[i], self._procs[i], "ready")
        return [budgets[i] for i in range(len(self._procs))]

    def failure(self, wait: float = 2.0) -> str | None:
        """Why a collective failed, from the workers' side: the traceback a worker sent
        before it exited (a step that raised in it), else which ones have exited and how.
        Rank 0's own error is only gloo's "Connection closed by peer". None if every worker
        still runs and reported nothing within `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            # A worker sends its traceback before it exits, so it is in the pipe by the time
            # its peers see the connection close. Workers whose own all-reduce failed after
            # that (CollectiveError) send none: the report found is the first failure's.
            for conn, proc in zip(self._conns, self._procs):
                try:
                    if conn.poll():
                        kind, payload = conn.recv()
                        if kind == "error":
                            return f"tensor-parallel worker {proc.name} failed:\n{payload}"
                except (EOFError, OSError):
                    pass
            exited = [f"{proc.name} (exit code {proc.exitcode})"
                      for proc in self._procs if not proc.is_alive()]
            if exited:
                return "tensor-parallel worker exited: " + ", ".join(exited)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def connect(self, device: torch.device) -> TensorParallelGroup:
        """Rank 0's side of the all-reduce group (the workers join it once ready). The
        rendezvous waits on a thread while the workers are watched: one that fails or dies
        meanwhile raises its error here rather than after the group's 10-minute timeout."""
        joined: list[Any] = []  # the group, or the exception that ended the rendezvous

        def join() -> None:
            try:
                joined.append(TensorParallelGroup(0, self.config.world_size, "127.0.0.1",
                                                  self.port, device, store=self.store))
            except BaseException as e:  # noqa: BLE001 (re-raised on the engine's thread)
                joined.append(e)

        # A daemon thread: after an error it is left blocked until the rendezvous times out,
        # and must not hold the process open at exit meanwhile.
        thread = threading.Thread(target=join, name="argosy-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            for conn, proc in zip(self._conns, self._procs):
                if thread.is_alive() and (conn.poll() or not proc.is_alive()):
                    self._receive(conn, proc, "connected")  # raises the worker's error
        if isinstance(joined[0], BaseException):
            raise joined[0]
        self.group = joined[0]
        self.group.explain_failure = self.failure
        return self.group

    @property
    def is_alive(self) -> bool:
        """False once a worker has exited or the ranks fell out of step: this engine can run
        no step again (what a liveness check should report)."""
        return self.broken is None and all(proc.is_alive() for proc in self._procs)

    def allocate(self, cache_config: CacheConfig) -> None:
        self._send(("allocate", cache_config))

    def run_step(self, entries: list) -> None:
        """Have every worker run the forward of this step's batch (ModelRunner.forward)."""
        if self.broken is not None:
            raise WorkerFailed(self.broken)
        self._check_in_step()
        self._send(("step", entries))
        self._steps_sent += 1

    def _check_in_step(self) -> None:
        """WorkerFailed, and the workers stopped, if rank 0's last forward stopped partway.

        Rank 0's forward can raise between its all-reduces (out of memory, a kernel's error):
        the step fails, the server keeps serving, and the workers wait in the next
        all-reduce of that step. Rank 0's next step would then meet them there: its first
        all-reduce summed with another layer's (wrong tokens, no error), until two sizes
        differed and gloo aborted the whole process. Each worker either finishes its step,
        or waits in an all-reduce rank 0 never started (one more than rank 0's count).

        On CUDA a worker's all-reduces do not block its Python thread, so it may report its
        step done with an all-reduce still queued: there only `abandon` (called when rank 0's
        forward raises) keeps the ranks from running out of step."""
        reduces = self.group.num_all_reduces if self.group is not None else 0
        for progress, proc in zip(self._progress, self._procs):
            while progress[1] < self._steps_sent and proc.is_alive():  # a dead one: _send
                if progress[0] > reduces:
                    raise self.abandon(f"rank 0's step failed partway through the model while "
                                        f"{proc.name} went on (rank 0's error was raised then)")
                time.sleep(0.0001)  # finishing its last layer: its last all-reduce is done

    def abandon(self, why: str) -> WorkerFailed:
        """Stop the workers for good: the ranks are out of step (`why`). Every later step
        raises the returned error, which says so."""
        self.broken = (f"tensor-parallel ranks are out of step: {why}; the workers are "
                       "stopped and this engine can run no more steps: restart it")
        self.close(timeout=0.0)  # they wait in an all-reduce: no "stop" message is read
        return WorkerFailed(self.broken)

    def _send(self, message: tuple) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(message)
            except OSError as e:
                raise WorkerFailed(f"tensor-parallel worker {proc.name} is gone (exit code "
                                   f"{proc.exitcode})") from e

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
        for conn in self._conns:
            conn.close()
        logger.info("tensor-parallel workers stopped")
