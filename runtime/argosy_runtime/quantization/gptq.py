"""GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers "gptq" safetensors layout, 4 bits).

Per quantized linear `<module>` ([N out, K in], group size G, ng = ceil(K / G)):
- `<module>.qweight` int32 [K / 8, N]: eight 4-bit values along K per int32, input
  8r + j in bits 4j..4j+3;
- `<module>.qzeros` int32 [ng, N / 8]: zero points packed the same way along N;
  `checkpoint_format` "gptq" (v1, the default) stores zero - 1, "gptq_v2" the zero itself;
- `<module>.scales` float16 [ng, N];
- `<module>.g_idx` int32 [K] (optional): the group of each input; with act-order
  (desc_act) it is not k // G, and the layer permutes its input so groups are contiguous.
w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].
"""

from __future__ import annotations

import torch

from argosy_runtime.quantization.rtn import Int4Weight

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of an int32 at bits 4j


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R * 8, C]: value j of packed[r, c] goes to row 8r + j."""
    vals = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 15  # [R, 8, C]
    return vals.reshape(-1, packed.shape[1])


def unpack_int32_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * 8]: value j of packed[r, c] goes to column 8c + j."""
    vals = (packed.to(torch.int32)[:, :, None] >> _SHIFTS[None, None, :]) & 15  # [R, C, 8]
    return vals.reshape(packed.shape[0], -1)


def gptq_to_int4(
    name: str,
    tensors: dict[str, torch.Tensor],
    in_features: int,
    out_features: int,
    group_size: int,
    zero_offset: int = 1,
) -> Int4Weight:
    """Canonical int4 of one GPTQ linear. `tensors`: its qweight/qzeros/scales(/g_idx).

    `zero_offset` is 1 for the v1 format (stored zero = zero - 1) and 0 for gptq_v2.
    Raises ValueError naming the tensor when a shape does not fit the model's layer.
    """
    k, n, g = in_features, out_features, group_size
    ng = -(-k // g)
    _expect(name, tensors, "qweight", (k // 8, n), k % 8 == 0)
    _expect(name, tensors, "qzeros", (ng, n // 8), n % 8 == 0)
    _expect(name, tensors, "scales", (ng, n), True)
    q = unpack_int32_rows(tensors["qweight"])  # [K, N]
    zeros_int = unpack_int32_cols(tensors["qzeros"]) + zero_offset  # [ng, N]
    scales = tensors["scales"].float()  # [ng, N]
    g_idx = tensors.get("g_idx")
    input_perm = None
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{name}.g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        g_idx = g_idx.long()
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= ng:
            raise ValueError(f"{name}.g_idx has groups outside [0, {ng})")
        if not torch.equal(g_idx, torch.arange(k) // g):
            # Act-order: sort inputs by group so each group is contiguous again.
            counts = torch.bincount(g_idx, minlength=ng)
            expected = torch.full((ng,), g)
            expected[-1] = k - g * (ng - 1)
            if not torch.equal(counts, expected):
                raise ValueError(
                    f"{name}.g_idx does not give every group {g} inputs (group_size mismatch?)")
            input_perm = torch.sort(g_idx, stable=True).indices
            q = q[input_perm]
    qt = q.t().contiguous()  # [N, K]
    if ng * g != k:
        qt = torch.nn.functional.pad(qt, (0, ng * g - k), value=8)
    # w = (q - zero) * s = (q - 8) * s + (8 - zero) * s
    s = scales.t().contiguous()
    z = (8 - zeros_int.float()).t() * s
    return Int4Weight(qt.to(torch.uint8), s, z.contiguous(), g, k, input_perm)


def _expect(name: str, tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...],
            divisible: bool) -> None:
    if key not in tensors:
        raise ValueError(f"quantized layer {name} has no {key} tensor")
    actual = tuple(tensors[key].shape)
    if not divisible or actual != shape:
        raise ValueError(
            f"{name}.{key} has shape {actual}, expected {shape} for this model's layer "
            f"(the checkpoint's quantization layout or group_size does not match its config)"
        )
    if key != "scales" and tensors[key].dtype != torch.int32:
        raise ValueError(f"{name}.{key} must be int32, got {tensors[key].dtype}")
