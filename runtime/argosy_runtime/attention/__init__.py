"""Attention over the paged KV cache: metadata built once per step, and backends."""

from argosy_runtime.attention.metadata import AttentionMetadata
from argosy_runtime.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend"]
