"""CPU thread count: cgroup limits (v1 and v2), affinity, and the engine option."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from argosy_runtime.cpu_threads import cgroup_cpu_limit, configure_cpu_threads, default_cpu_threads


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit(tmp_path: Path) -> None:
    _write(tmp_path / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None


def test_default_is_the_smallest_of_torch_affinity_and_limit(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert default_cpu_threads(64, tmp_path) == min(64, affinity)
    _write(tmp_path / "cpu.max", "150000 100000\n")  # 1.5 CPUs -> 2 threads
    assert default_cpu_threads(64, tmp_path) == min(2, affinity)
    _write(tmp_path / "cpu.max", "10000 100000\n")  # a tenth of a CPU still gets one thread
    assert default_cpu_threads(64, tmp_path) == 1
    assert default_cpu_threads(1, Path("/nonexistent")) == 1


def test_configure_sets_torch_threads_and_rejects_nonsense() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_cpu_threads(1) == 1
        assert torch.get_num_threads() == 1
        # The default only ever lowers the count: an explicit torch.set_num_threads stands.
        assert configure_cpu_threads(None) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads"):
        configure_cpu_threads(0)
