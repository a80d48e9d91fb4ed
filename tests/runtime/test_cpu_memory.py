"""Memory left for a CPU KV cache: MemAvailable, a cgroup v2 limit, and the engine refusing a
cache that cannot fit (which the kernel's out-of-memory killer used to end, silently)."""

from __future__ import annotations

from pathlib import Path

import pytest
from argosy_runtime import LLM
from argosy_runtime.cpu_memory import available_memory


def test_mem_available_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   14000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 14_000_000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_memory(meminfo, cgroup) == 14_000_000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert available_memory(meminfo, cgroup) == 5 << 30  # the pod's limit is the smaller
    assert available_memory(tmp_path / "none", tmp_path / "none") is None


def test_a_cpu_kv_cache_past_the_available_memory_is_refused() -> None:
    available = available_memory()
    if available is None:
        pytest.skip("no /proc/meminfo here (not Linux)")
    # 1 PiB: far past any machine's memory, however much other processes free meanwhile
    # (available + 1 GiB raced with the rest of the suite freeing memory).
    assert available < 1 << 50
    with pytest.raises(ValueError, match=r"kv_cache_memory \(.* GiB\) is more than this "
                                         r"machine has available"):
        LLM(model="smollm2-135m", kv_cache_memory=1 << 50, max_model_len=256)
