"""Helpers for tests that watch real processes."""

from __future__ import annotations

from pathlib import Path


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopts it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
