"""Fused C++ kernels for the CPU decode path, built on first use (csrc/cpu_ops.cpp).

A decode step of a small model on the CPU is dominated by per-op overhead and by attention
shapes PyTorch's kernels are not built for (one query row per sequence). The C++ file holds
plain loops that gcc vectorizes for the machine it runs on; it is compiled once per machine
(about 10 s) with `torch.utils.cpp_extension` and cached under `$XDG_CACHE_HOME/argosy/cpu_ops`
(default `~/.cache`; `ARGOSY_CPU_OPS_CACHE` moves it). Where there is no C++ compiler, or the
build fails, or `ARGOSY_CPU_OPS=0`, `available()` is False and the callers keep their PyTorch
paths: every op here has a pure-torch reference it is tested against
(tests/kernels/test_cpu_ops.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger("argosy.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# -march=native: the build is per machine (the cache key includes the CPU's flags).
# -ffast-math: lets gcc vectorize float reductions and call glibc's vector expf; the kernels
# never rely on inf/NaN arithmetic (they loop over valid tokens only).
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-lmvec"]


def enabled_by_env() -> bool:
    return os.environ.get("ARGOSY_CPU_OPS", "1").lower() not in ("0", "false", "off", "no")


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False, logged once, if that fails."""
    if not enabled_by_env():
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.info("no C++ compiler found: fused CPU kernels off, using PyTorch ops")
        return False
    if shutil.which("ninja") is None:  # torch builds with ninja; the `ninja` wheel puts it
        venv_bin = str(Path(sys.executable).parent)  # beside the interpreter
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build_dir / "lock")
        load(name=f"argosy_cpu_ops_{build_dir.name}", sources=[str(_SOURCE)],
             extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, build_directory=str(build_dir),
             is_python_module=False, verbose=False)
    except Exception as exc:  # a compiler or linker error: fall back, loudly
        logger.warning("building the fused CPU kernels failed, using PyTorch ops: %s", exc)
        return False
    return True


def _remove_stale_lock(lock: Path, max_age_s: float = 300.0) -> None:
    """torch holds a lock file while one process builds and makes the others wait for it
    to go away, forever: a builder killed mid-build (a pod evicted at start-up) would hang
    every later start. A build takes seconds, so a lock older than `max_age_s` is stale."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > max_age_s:
        logger.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def _build_dir() -> Path:
    """One folder per (source, flags, torch version, CPU), so a cache shared between
    machines or upgrades never loads a library built for another."""
    cpu_flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                cpu_flags += line
    except OSError:
        cpu_flags = platform.processor()
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(),
                 torch.__version__.encode(), cpu_flags.encode()):
        key.update(part)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = Path(os.environ.get("ARGOSY_CPU_OPS_CACHE", cache_home / "argosy" / "cpu_ops"))
    return root / key.hexdigest()[:16]


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], float32 or bfloat16
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs], the current token included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:
    """`paged_decode_attention_ref` in one fused pass: no gathered copy of the blocks, one
    task per (sequence, kv head) over torch's threads, each context split into parts merged
    afterwards where there are too few of those to keep the threads busy. The query may be a
    row-strided view (q inside the fused qkv output). With a sliding window the blocks
    before it are not read."""
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.argosy_cpu.decode_attention(out, query, key_cache, value_cache, block_tables,
                                          context_lens, scale, k_scale, v_scale,
                                          sliding_window or 0, softcap or 0.0)
    return out


def has_avx512_bf16() -> bool:
    """Whether the kernels were built with AVX512-BF16 (the bfloat16-only kernels need it)."""
    return available() and torch.ops.argosy_cpu.has_avx512_bf16()


def varlen_shapes_supported(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `prefill_attention` / `varlen_attention` take these shapes (the checks of
    csrc/cpu_ops.cpp's run_varlen_attention: head_dim 64 or 128, at most 16 query heads per kv
    head); callers with other shapes keep their PyTorch path."""
    return head_dim in (64, 128) and num_heads // num_kv_heads <= 16


def prefill_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim] bfloat16, rows may be strided
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16 or int8
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [max_blocks]: this sequence's row
    seq_len: int,  # tokens in the cache after this chunk, the chunk included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # contiguous, like query
    sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:
    """`paged_prefill_attention_ref` for one sequence's chunk, flash-style straight over the
    cache blocks (bfloat16, needs `has_avx512_bf16()`); write the chunk's K/V first."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.argosy_cpu.prefill_attention(out, query, key_cache, value_cache, block_table,
                                           seq_len, scale, k_scale, v_scale, sliding_window or 0,
                                           softcap or 0.0)
    return out


def varlen_attention(
    query: torch.Tensor,  # [tokens, num_heads, head_dim] bfloat16, rows may be strided
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16 or int8
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]: sequence s's rows start..end
    seq_lens: torch.Tensor,  # int32 [num_seqs]: tokens in cache after this step, chunk included
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # float16 [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # contiguous, like query
    sliding_window: int | None = None,  # keys p - W < k <= p only; None: all of them
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: as they are
) -> torch.Tensor:
    """`prefill_attention` for the chunks of several sequences in one call (a decode row is a
    chunk of one query). Each query's output depends only on its own row and keys, bit for
    bit: not on the chunking, the other sequences, or the threads (the batch-invariant mode,
    docs/engine.md). With a sliding window, key tiles wholly before a task's window are
    skipped."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.argosy_cpu.varlen_attention(out, query, key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale, k_scale, v_scale,
                                          sliding_window or 0, softcap or 0.0)
    return out


# The ops below are called once or twice per layer per step: thin aliases keep the call cost
# at one dispatcher hop. Each op's reference is named in its line.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows, dim] -> weight * dtype(x * rsqrt(mean(x^2) + eps)) (models.llama.RMSNorm)."""
    return torch.ops.argosy_cpu.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> torch.Tensor:
    """residual += x in place (rounded to its dtype); returns rms_norm(residual)."""
    return torch.ops.argosy_cpu.rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * dim] -> silu(gate) * up, each rounded as eager PyTorch rounds."""
    return torch.ops.argosy_cpu.silu_and_mul(gate_up)


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [1, K] -> [1, N] = (x @ qweight.T) * scales, qweight int8 [N, K] (Int8Linear's
    weight-only product; reference: `Int8Linear.dequantize`). Streams the weight at the
    memory bandwidth: the batch-1 decode kernel."""
    return torch.ops.argosy_cpu.int8_gemv(x, qweight, scales)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] = (x @ qweight.T) * scales for many token rows (Int8Linear's path
    above `packed_max_tokens`; reference: `Int8Linear.dequantize`). bfloat16 on AVX512-BF16:
    16 weight rows at a time are widened into a small buffer that all tokens then stream
    through, 16 tokens per register; otherwise the weight is widened a cache-sized slice at a
    time and multiplied there with a GEMM."""
    return torch.ops.argosy_cpu.int8_matmul(x, qweight, scales)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                packed_max_tokens: int) -> torch.Tensor:
    """Int8Linear's product, the kernel picked by the number of token rows M: `int8_gemv` for
    one; up to `packed_max_tokens` argosy's few-row kernel in bfloat16, `_weight_int8pack_mm`
    in float32; `int8_matmul` above (the same rule `decode_layer` follows)."""
    return torch.ops.argosy_cpu.int8_linear(x, qweight, scales, packed_max_tokens)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp] values 0..15 (N % 16 == 0, Kp % 8 == 0) -> the int4 kernels' layout,
    uint8 [N, Kp/2]: tiles of 16 rows, each a run of 64-byte blocks of 8 inputs in which the
    16-bit word 2r + j holds row r's inputs 2f + j (f = 0..3) in bits 4f..4f+3."""
    n, kp = q.shape
    if n % 16 or kp % 8:
        raise ValueError(f"pack_int4 needs rows padded to a multiple of 16 and inputs to 8, got {n}x{kp}")
    fields = q.to(torch.uint8).view(n // 16, 16, kp // 8, 4, 2)  # tile, r, block, f, j
    fields = fields.permute(0, 2, 1, 4, 3)  # tile, block, r, j, f
    words = torch.stack([fields[..., 0] | (fields[..., 1] << 4),  # little endian: low byte
                         fields[..., 2] | (fields[..., 3] << 4)], dim=-1)
    return words.reshape(n, kp // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [N, Kp/2] -> values 0..15 uint8 [N, Kp]."""
    n, half = packed.shape
    words = packed.view(n // 16, half * 2 // 8, 16, 2, 2)  # tile, block, r, j, byte
    fields = torch.stack([words[..., 0] & 15, words[..., 0] >> 4,
                          words[..., 1] & 15, words[..., 1] >> 4], dim=-1)  # tile, block, r, j, f
    return fields.permute(0, 2, 1, 4, 3).reshape(n, half * 2).contiguous()


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [M, Kp] -> [M, N] with w = (q - 8) * scale + zero per group (Int4Linear's weight;
    qweight in `pack_int4` layout, scales_and_zeros [Kp / group, N, 2] of x's dtype). The
    weight is read once per call; bfloat16 x uses AVX512-BF16 dot products where the CPU has
    them, and from 16 rows dequantizes 16 weight rows at a time to bfloat16 (w rounded to
    bfloat16, as `Int4Linear.dequantize`) for all tokens to stream through."""
    return torch.ops.argosy_cpu.int4_matmul(x, qweight, scales_and_zeros, group_size)


def rotary_embedding(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """In place: qk = qk * cos + roll(qk, rot_dim / 2) * signed_sin over the first rot_dim (the
    tables' width, head_dim or a partial rotary's less) values of each head
    (models.rotary.RotaryEmbedding.rotate). qk: [tokens, heads, head_dim], rows may be strided."""
    torch.ops.argosy_cpu.rotary_embedding(qk, cos, signed_sin)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                      ) -> None:
    """`reshape_and_cache_ref`, bit for bit, int8 cache included (negative slots skipped)."""
    torch.ops.argosy_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                           k_scale, v_scale)
