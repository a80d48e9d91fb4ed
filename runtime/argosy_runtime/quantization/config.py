"""`QuantizationConfig`: which weight-only quantization to apply, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
# Where the quantized values come from: quantized at load time ("rtn": round to nearest), or
# kept from a pre-quantized checkpoint.
SOURCES = ("rtn", "gptq", "awq", "gguf")
ALGORITHMS = ("rtn", "gptq")


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of the decoder's linear layers (qkv/o/gate_up/down).

    - `method="int8"`: symmetric, one scale per output channel; `group_size` is ignored.
    - `method="int4"`: asymmetric, one scale and one zero point per `group_size` consecutive
      input features of every output channel. When `group_size` does not divide a layer's
      input size (SmolLM2's 576 with 128), the last group of each row is shorter (stored
      zero-padded), so every supported group size works on every model.
    - `clip_search`: for load-time int4, shrink each group's [min, max] range to the value
      (of a small grid) that minimizes the group's squared rounding error, instead of plain
      min/max round-to-nearest (lower error on outlier-heavy groups; a little slower to load).
    - `algorithm`: load-time int4 by "rtn" (round to nearest, the default) or "gptq"
      (calibrated on a built-in text sample, error-compensating; several times lower output
      error, but minutes of CPU at load for a 100M+ model).
    - `keep_gguf_blocks`: a GGUF tensor already in Q4_0/Q4_1 (4 bits, groups of 32) is kept
      bit-exact as int4 group 32 whatever `group_size` asks for: re-rounding 4-bit weights
      onto a coarser grid compounds two errors (on the embedded model: perplexity +60% at
      group 128 vs +0% kept). False forces the re-quantization.
    - `source`: "rtn" (quantize at load) or the pre-quantized format kept: gptq, awq, gguf.
    """

    method: str
    group_size: int = 128
    clip_search: bool = True
    algorithm: str = "rtn"
    keep_gguf_blocks: bool = True
    source: str = "rtn"

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization method must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.method!r}"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"quantization group_size must be an int, got {self.group_size!r}")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                f"for int4, got {self.group_size}"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"quantization algorithm must be one of {', '.join(ALGORITHMS)}, "
                             f"got {self.algorithm!r}")
        if self.algorithm == "gptq" and self.method != "int4":
            raise ValueError("quantization algorithm 'gptq' needs method 'int4'")
        if self.source not in SOURCES:
            raise ValueError(f"quantization source must be one of {', '.join(SOURCES)}, got {self.source!r}")

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4

    def describe(self) -> str:
        """Short human-readable name for logs and metrics: 'int8', 'int4-g128 (gptq)'."""
        name = "int8" if self.method == "int8" else f"int4-g{self.group_size}"
        return name if self.source == "rtn" else f"{name} ({self.source})"
