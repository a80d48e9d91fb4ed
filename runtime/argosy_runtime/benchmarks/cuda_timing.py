"""Timing GPU work for the benchmarks (bench/gpu_check.py, bench/gpu_matmul_tune.py): CUDA
events around a captured CUDA graph, and operands that rotate past the L2 cache."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

# What a set of operand copies should add up to so that calls rotating over them read device
# memory, as a model's layers do, not the L2 cache (60 MB on an H200) one copy would sit in.
L2_ROTATION_BYTES = 256 << 20


def copies_beyond_l2(nbytes_each: int) -> int:
    """How many copies of an operand of `nbytes_each` bytes to rotate over (at least 2)."""
    return max(2, -(-L2_ROTATION_BYTES // nbytes_each))


def cuda_seconds_per_call(calls: Sequence[Callable[[], Any]], reps: int = 5,
                          capture: bool = True) -> float:
    """Median seconds per call of running `calls` in order, `reps` times between CUDA events:
    captured once in a CUDA graph (no launch overhead in the number), or launched eagerly
    with capture=False. The first calls run before, as warm-up (compilation, allocations).
    A failed capture raises."""
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    graph = None
    if capture:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls[0]()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for call in calls:
                call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / len(calls))
    return statistics.median(times)
