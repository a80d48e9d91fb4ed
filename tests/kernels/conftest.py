"""Kernel tests: on a GPU when there is one, else on the CPU under Triton's interpreter.

`TRITON_INTERPRET` must be set before the first kernel launch (the kernels are jitted lazily,
so setting it here, before any test runs, is enough).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
