"""Load-time quantizers (round to nearest) and the canonical quantized forms they return.

Canonical forms, shared by every source (load time, GPTQ, AWQ, GGUF) before a module packs
them for its kernel:

- int8: `q` int8 [N, K] in [-127, 127], `scale` float32 [N]; w = q * scale.
- int4: `q` uint8 [N, Kp] in [0, 15], `scales`/`zeros` float32 [N, ng]; w = (q - 8) * s + z
  for input feature k in group k // group_size, with Kp = ng * group_size >= K (the tail of a
  row whose length is not a multiple of the group size is padded; the pad is never read
  because activations are zero-padded to match). This "float zero" form is what PyTorch's
  CPU int4 kernel computes, and it represents integer zero points (GPTQ/AWQ: (q - zp) * s,
  z = (8 - zp) * s) and GGUF's Q4_1 (q * d + m, z = m + 8 d) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Int4Weight:
    q: torch.Tensor  # uint8 [N, Kp], values 0..15
    scales: torch.Tensor  # float32 [N, ng]
    zeros: torch.Tensor  # float32 [N, ng]
    group_size: int
    in_features: int  # K (<= Kp)
    # int64 [K] or None: GPTQ act-order checkpoints store input features out of group order;
    # the layer then multiplies x[..., input_perm] (see Int4Linear).
    input_perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the original input-feature order."""
        n, kp = self.q.shape
        g = self.group_size
        w = (self.q.float().view(n, kp // g, g) - 8) * self.scales[..., None] + self.zeros[..., None]
        w = w.view(n, kp)[:, : self.in_features]
        if self.input_perm is not None:
            out = torch.empty_like(w)
            out[:, self.input_perm] = w
            w = out
        return w


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of `w` [N, K] (any float dtype)."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


# Fractions of the full [min, max] range tried by the clip search (1.0 = plain min/max).
_CLIP_GRID = torch.linspace(1.0, 0.75, 6).tolist()


def quantize_int4(w: torch.Tensor, group_size: int, clip_search: bool = True) -> Int4Weight:
    """Asymmetric group-wise int4 of `w` [N, K]: per group of `group_size` inputs, 16 levels
    spanning [min, max] (or, with `clip_search`, the shrunken range of lowest squared error)."""
    w = w.float()
    n, k = w.shape
    ng = -(-k // group_size)
    kp = ng * group_size
    if kp != k:
        # Replicate the last column: the pad then never widens the last group's range.
        w = torch.cat([w, w[:, -1:].expand(n, kp - k)], dim=1)
    groups = w.view(n, ng, group_size)
    lo = groups.amin(dim=2)
    hi = groups.amax(dim=2)
    best_q, best_s, best_lo = _int4_round(groups, lo, hi)
    if clip_search:
        # 1 for real inputs, 0 for the pad [ng, group_size]: the pad's replicated copies of
        # the last column must not count in the last group's error, or the search picks the
        # range that best fits that one column (65 copies of it for 576 inputs at group 128)
        # instead of the group's real inputs.
        real = (torch.arange(kp) < k).to(w.dtype).view(ng, group_size)
        best_err = _int4_error(groups, best_q, best_s, best_lo, real)
        mid = (lo + hi) / 2
        for frac in _CLIP_GRID[1:]:
            c_lo = mid - (mid - lo) * frac
            c_hi = mid + (hi - mid) * frac
            q, s, base = _int4_round(groups, c_lo, c_hi)
            err = _int4_error(groups, q, s, base, real)
            better = err < best_err  # [N, ng]
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better[..., None], q, best_q)
            best_s = torch.where(better, s, best_s)
            best_lo = torch.where(better, base, best_lo)
    zeros = best_lo + 8 * best_s
    return Int4Weight(best_q.view(n, kp).to(torch.uint8), best_s, zeros, group_size, k)


def _int4_round(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return q, scale, lo


def _int4_error(groups: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                real: torch.Tensor) -> torch.Tensor:
    deq = q * scale[..., None] + lo[..., None]
    return ((deq - groups).pow(2) * real).sum(dim=2)
