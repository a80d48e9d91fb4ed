"""How much memory a CPU process may still take: for a KV cache that must fit.

A CPU KV cache is allocated zero-filled, so every page is touched at start-up: a
`--kv-cache-memory` past what the machine (or the pod's memory limit) has left gets the
process killed by the kernel's out-of-memory killer, with no message, after the model loaded.
The engine refuses such a size instead, naming what is available.
"""

from __future__ import annotations

from pathlib import Path


def available_memory(meminfo: Path = Path("/proc/meminfo"),
                     cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process can still allocate: the smaller of the kernel's MemAvailable and
    what the cgroup (v2) memory limit leaves (`memory.max` - `memory.current`); None where
    neither can be read (not Linux)."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((cgroup / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
