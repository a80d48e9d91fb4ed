"""Rotary position embeddings, computed exactly as Hugging Face transformers does.

Matching transformers bit for bit matters: greedy outputs are compared token for token.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None,
                  max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the attention scaling factor.

    `head_dim` is the rotated width (a partial rotary's rotary_dim). `max_positions` (the
    served context length) picks longrope's factor list: see `_longrope_inv_freq`."""
    if rope_scaling and rope_scaling.get("rope_type") == "longrope":
        return _longrope_inv_freq(head_dim, theta, rope_scaling, max_positions)
    if rope_scaling and rope_scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(head_dim, theta, rope_scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq, 1.0
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, "
        "longrope, yarn)"
    )


def _longrope_inv_freq(dim: int, theta: float, cfg: dict, max_positions: int | None
                       ) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3-128k, Phi-3.5-mini, Phi-4-mini): each frequency divided by its own
    factor, cos/sin scaled by `attention_factor` (ModelSpec fills it in, and
    `original_max_position_embeddings`).

    transformers picks `long_factor` for a forward whose max(position) + 1 exceeds
    original_max_position_embeddings, else `short_factor`; it so rotates a sequence's early
    keys differently once it grows past that length. One table for every sequence cannot
    follow it, so the choice is vLLM's, by the served context length: long factors when
    `max_positions` (max_model_len) exceeds original_max_position_embeddings, short ones
    otherwise. This equals transformers for every sequence when max_model_len <= original
    (Phi-3's 4096), and, with a longer max_model_len, for sequences longer than that from
    their prompt on."""
    try:
        original = int(cfg["original_max_position_embeddings"])
        attention_factor = float(cfg["attention_factor"])
        factors = cfg["long_factor"] if (max_positions or 0) > original else cfg["short_factor"]
    except KeyError as exc:
        raise ValueError(f"longrope rope_scaling needs {exc.args[0]!r}") from exc
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors must number rotary_dim / 2 = {dim // 2}, "
                         f"got {len(factors)}")
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta ** inv_freq_shape), attention_factor


def _yarn_inv_freq(dim: int, theta: float, cfg: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context, SmolLM3), op for op as transformers'
    `_compute_yarn_parameters`, so that the tables are bit for bit its own: the frequencies
    blend interpolated (divided by `factor`) and original ones along a linear ramp between
    the dimensions that turn `beta_fast` and `beta_slow` times over
    `original_max_position_embeddings` positions (floor / ceil unless `truncate` is false).
    cos/sin are scaled by `attention_factor`, else derived from `factor` (and `mscale` /
    `mscale_all_dim` when both are set): vLLM's YaRNScalingRotaryEmbedding agrees.
    ModelSpec fills in `original_max_position_embeddings` and a null `factor`."""
    try:
        factor = cfg["factor"]
        original = cfg["original_max_position_embeddings"]
    except KeyError as exc:
        raise ValueError(f"yarn rope_scaling needs {exc.args[0]!r}") from exc
    attention_factor = cfg.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = cfg.get("mscale"), cfg.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # (`or`: transformers takes a 0 / null beta for its default too)
    beta_fast, beta_slow = cfg.get("beta_fast") or 32, cfg.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension turning that many times
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # 1: the original frequency, 0: interpolated. (1 - (1 - ramp), not ramp: transformers' bits)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The YaRN paper's attention scale 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor = cfg["factor"]
    low_freq_factor = cfg["low_freq_factor"]
    high_freq_factor = cfg["high_freq_factor"]
    old_context_len = cfg["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _cos_sin(head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_positions, head_dim // 2], times the attention scaling."""
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, rope_scaling, max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position; applied to q and k out of place.

    transformers computes `x * cos + rotate_half(x) * sin` with rotate_half(x) = cat(-x2, x1).
    Here the sign lives in the table instead: roll(x) = cat(x2, x1) times a sin whose first
    half is negated. Negation is exact, so every product and sum is bit for bit the same, with
    one roll instead of a slice, a negation and a cat.

    The Triton rotary kernel reads another layout, `cos_sin_cache` (float32 [max_positions,
    head_dim]: cos, then sin, of the head_dim / 2 frequencies, with the same scaling), built
    by `build_cos_sin_cache()` when the model switches to the Triton ops.

    A partial rotary (`rotary_dim` < head_dim, Phi-4-mini) turns only the first rotary_dim
    values of each head, pairs (i, i + rotary_dim / 2), and passes the rest through, as
    transformers' apply_rotary_pos_emb does: every table is then rotary_dim wide (the C++
    and Triton kernels read the width from it).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 rope_scaling: dict | None, dtype: torch.dtype,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.is_partial = self.rotary_dim < head_dim
        self.half = self.rotary_dim // 2
        self._table_args = (self.rotary_dim, max_positions, theta, rope_scaling)
        cos, sin = _cos_sin(*self._table_args)  # [max_positions, rotary_dim // 2] each
        signed_sin = torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)
        self.register_buffer("signed_sin", signed_sin.to(dtype), persistent=False)
        self.cos_sin_cache: torch.Tensor | None = None

    def build_cos_sin_cache(self) -> None:
        """On the device of the other tables: call it after moving the model. (A plain
        attribute, not a buffer, so that the model's .to(dtype) keeps it float32.)"""
        cos, sin = _cos_sin(*self._table_args)
        self.cos_sin_cache = torch.cat((cos, sin), dim=-1).to(self.cos.device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [num_tokens, 1, rotary_dim]: index once per step, use in
        every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] (q and k may be rotated together)."""
        cos, signed_sin = tables
        if self.is_partial:
            rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return torch.cat((rot * cos + rot.roll(self.half, dims=-1) * signed_sin, rest), dim=-1)
        return x * cos + x.roll(self.half, dims=-1) * signed_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        tables = self.tables(positions)
        return self.rotate(q, tables), self.rotate(k, tables)
