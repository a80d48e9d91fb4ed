"""Which replica runs a batch when several share one `--batch-dir` (a ReadWriteMany volume).

A batch runs only in the process holding an exclusive `flock` on `<batch id>.lock` beside its
record. The lock is held for as long as the batch runs there and released when it stops for
any reason: finished, the server drained, or the process died (the kernel drops the locks of a
dead process; on NFS the server does when the client's lease lapses). Any other replica that
finds the batch unfinished and the lock free takes it over, and resumes it from its result
files (batch_results.py). So a batch outlives the replica that started it.

flock, not fcntl/lockf: POSIX record locks belong to the process and vanish when any of its
descriptors for the file closes; flock locks belong to one open file, so two runners in one
process (tests) exclude each other as two processes do. Linux implements flock on NFS with
NFS byte-range locks, so it holds across nodes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class BatchLock:
    """One held lock; `release()` (idempotent) gives it up."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, path: Path) -> BatchLock | None:
        """The lock, or None when another runner holds it (never blocks)."""
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
