"""AWQ checkpoints (AutoAWQ "gemm" version, 4 bits, zero point), kept in int4.

Per quantized linear `<module>` ([N out, K in], group size G, ng = ceil(K / G)):
- `<module>.qweight` int32 [K, N / 8]: eight 4-bit values along N per int32, stored in
  AutoAWQ's interleaved order: nibble i holds column 8c + AWQ_ORDER[i];
- `<module>.qzeros` int32 [ng, N / 8]: zero points, same packing;
- `<module>.scales` float16 [ng, N].
w[n, k] = (q[k, n] - zero[k // G, n]) * scale[k // G, n].
"""

from __future__ import annotations

import torch

from argosy_runtime.quantization.gptq import _expect, unpack_int32_cols
from argosy_runtime.quantization.rtn import Int4Weight

AWQ_SUFFIXES = ("qweight", "qzeros", "scales")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of each int32 -> column offset AWQ_ORDER[i]
# column offset p -> nibble holding it
_AWQ_REVERSE = torch.tensor([AWQ_ORDER.index(p) for p in range(8)])


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * 8] in natural column order."""
    vals = unpack_int32_cols(packed).view(packed.shape[0], -1, 8)  # [R, C, nibble]
    return vals[:, :, _AWQ_REVERSE].reshape(packed.shape[0], -1)


def awq_to_int4(name: str, tensors: dict[str, torch.Tensor], in_features: int,
                out_features: int, group_size: int) -> Int4Weight:
    """Canonical int4 of one AWQ linear; ValueError naming the tensor on a layout mismatch."""
    k, n, g = in_features, out_features, group_size
    ng = -(-k // g)
    _expect(name, tensors, "qweight", (k, n // 8), n % 8 == 0)
    _expect(name, tensors, "qzeros", (ng, n // 8), n % 8 == 0)
    _expect(name, tensors, "scales", (ng, n), True)
    q = _unpack_awq(tensors["qweight"]).t().contiguous()  # [N, K]
    zeros_int = _unpack_awq(tensors["qzeros"]).float()  # [ng, N]
    if ng * g != k:
        q = torch.nn.functional.pad(q, (0, ng * g - k), value=8)
    s = tensors["scales"].float().t().contiguous()  # [N, ng]
    z = ((8 - zeros_int).t() * s).contiguous()
    return Int4Weight(q.to(torch.uint8), s, z, g, k)
