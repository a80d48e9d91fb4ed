"""A fleet replica exits when the fleet process that started it dies.

`argosy fleet` drains its replicas on SIGTERM and Ctrl-C, but a fleet killed outright
(SIGKILL, the OOM killer, a crash) runs no cleanup, and its replicas would live on as orphans
holding their ports, their memory and a copy of the model. The fleet starts each replica with
EXIT_WITH_PARENT_ENV set to its own pid; the replica (`argosy serve`) then asks Linux to send
it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), so it drains and exits as if the
fleet had stopped it. A replica that SIGTERM does not stop (a hung event loop, a drain that
does not end) is SIGKILLed by a fleet that is alive after its drain timeout; an orphan kills
itself (and its process group: its tensor-parallel workers) after the same time,
EXIT_WITH_PARENT_GRACE_ENV seconds. Elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import threading
import time

EXIT_WITH_PARENT_ENV = "ARGOSY_EXIT_WITH_PARENT"
EXIT_WITH_PARENT_GRACE_ENV = "ARGOSY_EXIT_WITH_PARENT_GRACE_S"
DEFAULT_GRACE_S = 60.0  # the fleet's own drain timeout (FleetConfig.drain_timeout_s)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent_if_asked() -> None:
    """If started by a fleet (EXIT_WITH_PARENT_ENV holds its pid), get SIGTERM when it dies,
    and SIGKILL EXIT_WITH_PARENT_GRACE_ENV seconds later if still running. Removes the
    variables, so this process's own children do not inherit the request."""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)
    grace = os.environ.pop(EXIT_WITH_PARENT_GRACE_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    # A separate thread, not the signal handler: it still runs when the main thread cannot
    # act on SIGTERM (blocked, or the signal ignored).
    threading.Thread(target=_kill_when_orphaned,
                     args=(int(parent), float(grace) if grace else DEFAULT_GRACE_S),
                     name="argosy-orphan-watch", daemon=True).start()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not fatal: the watch thread still kills an orphan after the grace period
    if os.getppid() != int(parent):  # the fleet died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _kill_when_orphaned(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    if not math.isfinite(grace_s):  # the fleet would wait for its drain too
        return
    time.sleep(grace_s)  # SIGTERM's drain (PR_SET_PDEATHSIG) has had its time
    print(f"the fleet (pid {parent}) that started this replica is gone and SIGTERM did not "
          f"stop it within {grace_s:g} s: SIGKILL", file=sys.stderr, flush=True)
    # The fleet starts each replica as the leader of its own process group (its workers in
    # it); a process started otherwise kills only itself.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
