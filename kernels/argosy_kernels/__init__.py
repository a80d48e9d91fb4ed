"""Argosy kernels: Triton kernels for the GPU path, each with a pure-torch reference.

Every `<op>.py` holds `_<op>_kernel` (Triton), `<op>()` (checks and launch) and `<op>_ref()`
(pure torch, also the CPU production path). Triton is imported lazily by the kernel functions
so the references work where Triton is not installed.
"""
