"""Frozen, validated configuration per concern (built from EngineArgs by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from argosy_runtime.engine_args import check_max_loras
from argosy_runtime.kv_cache.layout import KVCacheLayout

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {name!r}"
        ) from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be cpu, cuda or auto; got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device=cuda requested but no CUDA device is available")
    return torch.device(name)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    cache_dtype: torch.dtype  # torch.int8 for the int8 KV cache
    enable_prefix_caching: bool
    # Which page slot and block table each layer uses (kv_cache/layout.py); None: one table
    # and pages of every layer.
    layout: KVCacheLayout | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError("kv_cache_memory is too small for even one KV-cache block")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_loras: int | None = None  # most distinct LoRA adapters per step; None: no cap
    # With chunked prefill, the most prompt tokens one request prefills per step; None: the
    # budget is the only cap. Without chunked prefill a prompt runs whole: not used.
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        check_max_loras(self.max_loras)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
