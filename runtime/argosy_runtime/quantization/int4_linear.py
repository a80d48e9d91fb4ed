"""`Int4Linear`: weight-only int4 linear layer, group-wise scales and (float) zero points.

w[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n] with g = k // group_size, q in [0, 15].

`scales_and_zeros` is [ng, N, 2] in the activation dtype everywhere; `qweight`'s layout
follows the device and the kernels available there (`layout`):
- "cpu_ops" (the CPU, where argosy_kernels' fused CPU kernels build): uint8 [N, Kp/2] in
  `cpu_ops.pack_int4`'s order. Up to `packed_max_tokens` (2048) token rows run
  `cpu_ops.int4_matmul` (AVX512-BF16 dot products on bfloat16: 1.3-1.5x PyTorch's int4
  kernel at 1 row here; from 16 rows it dequantizes 16 weight rows at a time to bfloat16 and
  streams every token through them), more rows dequantize-then-GEMM;
- "cpu" (the CPU otherwise): PyTorch's packed layout for `_weight_int4pack_mm_for_cpu` (made by
  `_convert_weight_to_int4pack_for_cpu`, uint8 [N, Kp/2]), used up to `packed_max_tokens` (128)
  token rows (decode), dequantize-then-GEMM above (prefill);
- "cuda": argosy_kernels' int32 [N, Kp/8] layout (`pack_int4`) for the Triton
  `w4a16_matmul`, with float32 `kernel_scales`/`kernel_zeros` [N, ng] in its convention
  w = (q - zero) * scale (zero = 8 - z / s), stored group-major (transposes of [ng, N]).
Moving the module between devices (`.to()`) repacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from argosy_kernels import cpu_ops
from torch import nn

from argosy_runtime.quantization.rtn import Int4Weight, quantize_int4

# Most token rows a call hands to the packed kernel before dequantize-then-GEMM wins, per CPU
# layout, measured here (docs/benchmarks/quantization.md, kernel crossover): PyTorch's kernel
# up to ~128-256 rows; cpu_ops.int4_matmul (its many-row path from 16 rows) faster than the
# torch unpack + oneDNN GEMM up to 2048 rows on every SmolLM2 shape, level or slower at 4096.
INT4_PACKED_MAX_TOKENS = {"cpu": 128, "cpu_ops": 2048}
_CPU_INNER_K_TILES = 2  # only used by the CUDA variant of the op; any valid value works on CPU


class Int4Linear(nn.Module):
    """Group-wise int4 weight-only linear. Build with `from_weight` or `from_linear`."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, input_perm: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.num_groups = -(-in_features // group_size)
        self.padded_in_features = self.num_groups * group_size  # Kp
        # The CPU packing wants N % 16 == 0: extra output rows (all zero weights) are cut off.
        self.padded_out_features = -(-out_features // 16) * 16  # Np
        self.register_buffer("qweight", torch.zeros(self.padded_out_features,
                                                    self.padded_in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(self.num_groups, self.padded_out_features, 2, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self.register_buffer("input_perm", torch.arange(in_features) if input_perm else None)
        # CUDA layout only (see module docstring); derived, so not saved in state dicts.
        self.register_buffer("kernel_scales", None, persistent=False)
        self.register_buffer("kernel_zeros", None, persistent=False)
        # Set by LlamaForCausalLM.use_batch_invariant_kernels (plain cpu_ops layers only):
        # cpu_ops' many-row kernel for every row count.
        self.batch_invariant = False
        self._set_layout(preferred_cpu_layout())

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_weight(cls, weight: Int4Weight, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """Build (on the CPU) from a canonical int4 weight; `.to("cuda")` repacks for CUDA."""
        n, kp = weight.q.shape
        layer = cls(weight.in_features, n, weight.group_size, bias=bias is not None, dtype=dtype,
                    input_perm=weight.input_perm is not None)
        if kp != layer.padded_in_features:
            raise ValueError(f"int4 weight has {kp} padded inputs, expected {layer.padded_in_features}")
        pad_n = layer.padded_out_features - n
        q, scales, zeros = weight.q.cpu(), weight.scales, weight.zeros
        if pad_n:
            q = F.pad(q, (0, 0, 0, pad_n))
            scales, zeros = F.pad(scales, (0, 0, 0, pad_n)), F.pad(zeros, (0, 0, 0, pad_n))
        layer.qweight.copy_(_pack(q, layer.layout))
        layer.scales_and_zeros.copy_(torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype))
        if bias is not None:
            layer.bias.copy_(bias)
        if weight.input_perm is not None:
            layer.input_perm.copy_(weight.input_perm)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, clip_search: bool = True
                    ) -> Int4Linear:
        """Quantize an nn.Linear (round to nearest, optional clip search)."""
        w = linear.weight.detach()
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_weight(quantize_int4(w.cpu(), group_size, clip_search), bias, w.dtype)

    # ---- reference -------------------------------------------------------------------------
    def unpacked(self) -> torch.Tensor:
        """The 4-bit values, uint8 [Np, Kp], whatever the storage layout."""
        if self.layout == "cpu_ops":
            return cpu_ops.unpack_int4(self.qweight)
        if self.layout == "cpu":
            return unpack_cpu(self.qweight, self.padded_out_features, self.padded_in_features,
                              self.group_size)
        from argosy_kernels.w4a16_matmul import unpack_int4

        return unpack_int4(self.qweight)

    def dequantize(self, padded: bool = False) -> torch.Tensor:
        """The weight [N, K] (in the input order the layer multiplies, i.e. after input_perm)
        in the scales' dtype; [Np, Kp] with `padded`."""
        q = self.unpacked()
        sz = self.scales_and_zeros
        n, g = self.padded_out_features, self.group_size
        scale = sz[..., 0].t()[..., None]  # [N, ng, 1]
        base = (sz[..., 1] - 8 * sz[..., 0]).t()[..., None]
        w = q.to(sz.dtype).view(n, self.num_groups, g).mul_(scale).add_(base).view(n, -1)
        return w if padded else w[: self.out_features, : self.in_features]

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:  # the many-row kernel for any row count (batch_invariance.py)
            out = torch.ops.argosy_cpu.int4_matmul(x.reshape(-1, self.in_features).contiguous(),
                                                   self.qweight, self.scales_and_zeros,
                                                   self.group_size, 1)
            return out.view(*x.shape[:-1], self.out_features)
        if (self._plain_cpu_ops and x.dim() == 2 and x.shape[0] <= self.packed_max_tokens
                and x.dtype == self.scales_and_zeros.dtype and x.is_contiguous()):
            # Decode's case, checked first: each layer calls this 4 times per step, and the
            # general path's checks cost as much Python time as the kernel's own dispatch.
            return torch.ops.argosy_cpu.int4_matmul(x, self.qweight, self.scales_and_zeros,
                                                    self.group_size)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.input_perm is not None:
            x2 = x2.index_select(1, self.input_perm)
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))  # zeros meet the pad
        if x.device.type == "cuda":
            out = self._forward_cuda(x2)
        elif self.layout == "cpu_ops" and x.dtype in (torch.float32, torch.bfloat16):
            out = self._forward_cpu_ops(x2)
        elif self.layout == "cpu" and (x2.shape[0] <= self.packed_max_tokens
                                       or not fast_unpack_supported(self.padded_out_features)):
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.qweight, self.group_size, self._scales_and_zeros(x.dtype))
        else:
            out = F.linear(x2, self.dequantize(padded=True).to(x.dtype))
        if self.padded_out_features != self.out_features:
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        sz = self.scales_and_zeros
        return sz if sz.dtype == dtype else sz.to(dtype)

    def _forward_cpu_ops(self, x2: torch.Tensor) -> torch.Tensor:
        sz = self._scales_and_zeros(x2.dtype)
        if x2.shape[0] <= self.packed_max_tokens:
            return cpu_ops.int4_matmul(x2.contiguous(), self.qweight, sz, self.group_size)
        return F.linear(x2, self.dequantize(padded=True).to(x2.dtype))

    def _forward_cuda(self, x2: torch.Tensor) -> torch.Tensor:
        if self.layout != "cuda":
            self.repack("cuda")
        kernel = _cuda_kernel()
        if kernel is None:
            return F.linear(x2, self.dequantize(padded=True).to(x2.dtype))
        return kernel(x2, self.qweight, self.kernel_scales, self.kernel_zeros, self.group_size)

    def repack(self, layout: str) -> None:
        """Switch the storage to "cpu_ops", "cpu" or "cuda" layout (see the module docstring),
        on the device the buffers are on now."""
        if layout == self.layout:
            return
        if layout not in ("cpu_ops", "cpu", "cuda"):
            raise ValueError(f"layout must be 'cpu_ops', 'cpu' or 'cuda', got {layout!r}")
        device = self.qweight.device
        self.qweight = _pack(self.unpacked().cpu(), layout).to(device)
        self.kernel_scales = self.kernel_zeros = None
        if layout == "cuda":
            # Group-major ([ng, Np] contiguous, handed over as its [Np, ng] transpose): the
            # scales of neighbouring rows for one group sit side by side, so the one-row
            # kernel loads them for its 8 rows in two 16-byte loads where it needed 8 loads
            # (w4a16_matmul.default_config; compiled for sm_90: 1340 instructions a tile
            # instead of 1558).
            sz = self.scales_and_zeros.float()
            scale, zero = sz[..., 0], sz[..., 1]  # [ng, Np]
            # A group of one constant value c has scale 0 and z = c: GGUF Q4_1 blocks with
            # d = 0, or load-time int4 in float16 (its 1e-12 scale floor rounds to 0).
            # (q - zero) * 0 cannot give c, so such a group gets a scale 2^-20 |c| and the
            # zero point 8 - c / scale: (q - zero) * scale = c + (q - 8) * 2^-20 |c|.
            scale = torch.where(scale == 0, zero.abs() * 2.0**-20, scale)
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            self.kernel_scales = scale.contiguous().t()
            self.kernel_zeros = torch.where(scale == 0, torch.zeros_like(zero),
                                            8 - zero / safe).contiguous().t()
        self._set_layout(layout)

    def _set_layout(self, layout: str) -> None:
        self.layout = layout
        self.packed_max_tokens = INT4_PACKED_MAX_TOKENS.get(layout, 0)
        # Whether forward may hand x straight to cpu_ops.int4_matmul: nothing to permute, pad,
        # cut off or add (all fixed at construction, except the layout).
        self._plain_cpu_ops = (layout == "cpu_ops" and self.input_perm is None and self.bias is None
                               and self.padded_in_features == self.in_features
                               and self.padded_out_features == self.out_features)

    def _apply(self, fn: Callable, recurse: bool = True) -> Int4Linear:  # type: ignore[override]
        # A packed layout means nothing to another device's kernels: repack on device moves.
        target = fn(torch.zeros(1)).device
        self.repack(preferred_cpu_layout() if target.type == "cpu" else "cuda")
        return super()._apply(fn, recurse)

    # Both CPU layouts store uint8 [Np, Kp/2]: a state dict names its layout, so loading one
    # into a module of the other layout repacks instead of silently misreading the nibbles.
    def get_extra_state(self) -> dict:
        return {"layout": self.layout}

    def set_extra_state(self, state: dict) -> None:
        current = self.layout
        self._set_layout(state["layout"])  # what the loaded qweight holds
        self.repack(current)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"act_order={self.input_perm is not None}, layout={self.layout}")


# ---- packing ---------------------------------------------------------------------------------
def preferred_cpu_layout() -> str:
    """"cpu_ops" where argosy's fused CPU kernels build, else PyTorch's "cpu"."""
    return "cpu_ops" if cpu_ops.available() else "cpu"


def _pack(q: torch.Tensor, layout: str) -> torch.Tensor:
    """uint8 [N, Kp] values 0..15 -> `layout`'s qweight."""
    if layout == "cpu_ops":
        return cpu_ops.pack_int4(q)
    if layout == "cpu":
        return pack_cpu(q)
    from argosy_kernels.w4a16_matmul import pack_int4

    return pack_int4(q)


def pack_cpu(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp] values 0..15 -> PyTorch's CPU int4 layout uint8 [N, Kp/2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _CPU_INNER_K_TILES)


_FAST_LAYOUT: list[bool] = []


def fast_unpack_supported(n: int) -> bool:
    """Whether `unpack_cpu` can read this build's CPU layout with plain tensor ops.

    With AVX-512 the layout is blocks of 64 output rows, byte [nb, k, i] holding rows
    nb*64 + i (low nibble) and nb*64 + 32 + i (high nibble) of input k: checked once by
    packing a probe, since the layout is private to PyTorch and differs per ISA.
    """
    if not _FAST_LAYOUT:
        probe = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        _FAST_LAYOUT.append(bool(torch.equal(_unpack_cpu_blocked(pack_cpu(probe), 128, 64), probe)))
    return _FAST_LAYOUT[0] and n % 64 == 0


def _unpack_cpu_blocked(packed: torch.Tensor, n: int, kp: int) -> torch.Tensor:
    v = packed.view(n // 64, kp, 32)
    return torch.cat([v & 15, v >> 4], dim=2).transpose(1, 2).reshape(n, kp)


def unpack_cpu(packed: torch.Tensor, n: int, kp: int, group_size: int) -> torch.Tensor:
    """PyTorch's CPU int4 layout -> uint8 [N, Kp] values 0..15."""
    if fast_unpack_supported(n):
        return _unpack_cpu_blocked(packed, n, kp)
    # Any layout: multiply the identity with scale 1 and zero 8, which returns q itself.
    ng = kp // group_size
    sz = torch.stack([torch.ones(ng, n), torch.full((ng, n), 8.0)], dim=-1)
    eye = torch.eye(kp, dtype=torch.float32)
    qt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group_size, sz)  # [Kp, N]
    return qt.round().t().to(torch.uint8).contiguous()


_KERNEL: list = []


def _cuda_kernel():  # -> Callable | None
    """argosy_kernels' Triton w4a16_matmul, or None when unavailable."""
    if not _KERNEL:
        try:
            from argosy_kernels.w4a16_matmul import w4a16_matmul
        except ImportError:
            w4a16_matmul = None
        _KERNEL.append(w4a16_matmul)
    return _KERNEL[0]
