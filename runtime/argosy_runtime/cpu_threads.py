"""How many threads CPU math may use: the CPUs this process can actually run on.

PyTorch sizes its OpenMP pool from the machine's cores. In a Kubernetes pod with a CPU limit
that is wrong: a pod limited to 4 CPUs on a 64-core node would start 64 threads, and the CFS
quota then stalls all of them for the rest of each 100 ms period once 4 CPUs' worth of time is
spent (with spinning OpenMP threads that happens within a few ms). So the default here is the
smallest of PyTorch's own choice, the affinity mask (cpusets, `taskset`) and the cgroup CPU
limit rounded up.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger("argosy.engine")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 `cpu.max`, else v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us`), or None when there is no limit or no cgroup file to read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def default_cpu_threads(torch_default: int, root: Path = Path("/sys/fs/cgroup")) -> int:
    """min(PyTorch's default, CPUs in the affinity mask, ceil(cgroup limit)), at least 1."""
    candidates = [torch_default]
    if hasattr(os, "sched_getaffinity"):
        candidates.append(len(os.sched_getaffinity(0)))
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        candidates.append(math.ceil(limit))
    return max(1, min(candidates))


def configure_cpu_threads(requested: int | None) -> int:
    """Set PyTorch's intra-op thread count (process-wide) to `requested`, or lower it to the
    default above; returns the count."""
    import torch

    if requested is not None and requested < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {requested}")
    # The default never raises the current count: a caller's torch.set_num_threads stands.
    threads = requested or default_cpu_threads(torch.get_num_threads())
    if threads != torch.get_num_threads():
        logger.info("CPU math threads: %d (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
    return threads

