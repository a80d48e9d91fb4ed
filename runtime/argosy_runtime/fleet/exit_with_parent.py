"""A fleet replica exits when the fleet process that started it dies.

`argosy fleet` drains its replicas on SIGTERM and Ctrl-C, but a fleet killed outright
(SIGKILL, the OOM killer, a crash) runs no cleanup, and its replicas would live on as orphans
holding their ports, their memory and a copy of the model. The fleet starts each replica with
EXIT_WITH_PARENT_ENV set to its own pid; the replica (`argosy serve`) then asks Linux to send
it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), so it drains and exits as if the
fleet had stopped it. Elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

EXIT_WITH_PARENT_ENV = "ARGOSY_EXIT_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent_if_asked() -> None:
    """If started by a fleet (EXIT_WITH_PARENT_ENV holds its pid), get SIGTERM when it dies.
    Removes the variable, so this process's own children do not inherit the request."""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not fatal: only the orphan clean-up is lost
    if os.getppid() != int(parent):  # the fleet died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)
