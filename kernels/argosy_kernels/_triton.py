"""Lazy Triton plumbing shared by the kernels.

Kernels are written as plain module-level functions decorated with `triton_jit`. Triton is
imported, and the function handed to `triton.jit`, only on the first launch, because:
- the torch references in the same modules (the CPU production path) must import without
  Triton and without paying its import time;
- `triton.jit` decides between the compiler and the interpreter (`TRITON_INTERPRET=1`) when it
  decorates, so deciding at first launch lets tests set the variable after import.
The kernel bodies refer to the module-global name `tl`; it is bound in the kernel's module the
first time any kernel of that module is compiled.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


def triton_available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """A `@triton.jit` kernel compiled on first use; launch it as `kernel[grid](*args)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jitted: Any = None
        self._interpreted: bool | None = None

    def jitted(self) -> Any:
        interp = interpret_mode()
        if self._jitted is None or self._interpreted != interp:
            import triton
            import triton.language as tl

            self.fn.__globals__["tl"] = tl
            self._jitted = triton.jit(self.fn)
            self._interpreted = interp
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def triton_jit(fn: Callable[..., Any]) -> LazyKernel:
    """Decorator: mark `fn` as a Triton kernel, compiled lazily (see the module docstring)."""
    return LazyKernel(fn)


def check_device(*tensors: torch.Tensor) -> None:
    """Raise unless the tensors can be handed to a Triton kernel here.

    Triton kernels need CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`.
    """
    if not triton_available():
        raise RuntimeError("Triton is not installed; use the *_ref torch functions instead")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run "
            "them on the CPU, or call the *_ref function"
        )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 elsewhere); cached, since the
    launchers ask on every call."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sms(index)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
