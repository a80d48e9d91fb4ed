"""Suite-wide settings, applied before any test imports torch.

OpenMP threads busy-wait between parallel regions by default. The suite starts several
processes at once (server replicas, a gateway, the test process) on a 2-core machine, and
spinning threads then starve each other: one decode step measured 1-3 s instead of 60-90 ms.
Passive waiting is inherited by every subprocess the tests start.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
