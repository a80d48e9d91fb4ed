"""Weight-only quantization (int8 per channel, int4 group-wise) of the decoder's linears,
with an int8 lm_head (and tied embedding) in both modes.

    from argosy_runtime.quantization import QuantizationConfig, load_quantized_weights
    load_quantized_weights(model, checkpoint, QuantizationConfig("int4", group_size=128))

Sources: load-time round-to-nearest from any checkpoint, GPTQ and AWQ safetensors folders,
and GGUF Q4_0/Q4_1 blocks kept as int4 group 32. See docs/quantization.md.
"""

from __future__ import annotations

from argosy_runtime.quantization.apply import load_quantized_weights
from argosy_runtime.quantization.config import QuantizationConfig
from argosy_runtime.quantization.footprint import weight_bytes
from argosy_runtime.quantization.int4_linear import Int4Linear
from argosy_runtime.quantization.int8_embedding import Int8Embedding
from argosy_runtime.quantization.int8_linear import Int8Linear
from argosy_runtime.quantization.prequantized import detect_prequantized

__all__ = [
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "QuantizationConfig",
    "detect_prequantized",
    "load_quantized_weights",
    "weight_bytes",
]
